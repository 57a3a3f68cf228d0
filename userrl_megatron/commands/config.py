"""`userrl config show|validate`."""

import argparse
import sys


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The `--config FILE ... key=value ...` arguments every config-driven command takes."""
    p.add_argument(
        "--config", "-c", action="append", default=[], metavar="FILE", help="YAML file (repeatable, merged in order)"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.max_turns=4")


def _show(args: argparse.Namespace) -> int:
    from userrl_megatron.config import load_config, to_yaml
    from userrl_megatron.config.docs import explain

    cfg = load_config(args.config, args.overrides)
    print(explain(cfg) if args.explain else to_yaml(cfg).rstrip("\n"))
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Every check `userrl train` makes before start-up, for each file; one `userrl: error:` line per problem."""
    from userrl_megatron.config import ConfigError, load_config

    failed = 0
    for path in args.files:
        try:
            load_config([*args.config, path])
        except ConfigError as e:
            failed += 1
            for problem in e.problems:
                print(f"userrl: error: {path}: {problem}", file=sys.stderr)
        else:
            print(f"ok   {path}")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `config show` and `config validate`."""
    config = sub.add_parser("config", help="show or validate configurations")
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved configuration as YAML")
    add_config_args(show)
    show.add_argument("--explain", action="store_true", help="annotate every field with its documentation")
    show.set_defaults(handler=_show)
    validate = actions.add_parser(
        "validate", help="check configuration files (each on top of the defaults and the --config files)"
    )
    validate.add_argument(
        "--config", "-c", action="append", default=[], metavar="FILE", help="base YAML under each FILE (repeatable)"
    )
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(handler=_validate)
