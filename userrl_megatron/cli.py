"""`userrl`: the one command-line entry point (also `python -m userrl_megatron`).

Only argparse is imported at module level: each subcommand imports what it needs after parsing, so
`userrl --help` stays fast. Errors a user can fix (bad config, missing data) exit with status 2 and one message.
"""

import argparse
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int | None]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", "-c", action="append", default=[], metavar="FILE", help="YAML file (repeatable, merged in order)"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.max_turns=4")


def _cmd_config_show(args: argparse.Namespace) -> int:
    from userrl_megatron.config import load_config, to_yaml
    from userrl_megatron.config.docs import explain

    cfg = load_config(args.config, args.overrides)
    print(explain(cfg) if args.explain else to_yaml(cfg), end="" if not args.explain else "\n")
    return 0


def _cmd_config_validate(args: argparse.Namespace) -> int:
    from userrl_megatron.config import ConfigError, load_config

    failed = 0
    for path in args.files:
        try:
            load_config([path])
        except ConfigError as e:
            failed += 1
            print(f"FAIL {path}: {e}", file=sys.stderr)
        else:
            print(f"ok   {path}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    """The full `userrl` argument parser."""
    parser = argparse.ArgumentParser(
        prog="userrl", description="Multi-turn, user-centric RL: Megatron-core actors, SGLang rollout, UserRL gyms."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = sub.add_parser("config", help="show or validate configurations")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the resolved configuration as YAML")
    _add_config_args(show)
    show.add_argument("--explain", action="store_true", help="annotate every field with its documentation")
    show.set_defaults(handler=_cmd_config_show)
    validate = config_sub.add_parser("validate", help="check configuration files (each on top of the defaults)")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(handler=_cmd_config_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    from userrl_megatron.config.loader import ConfigError

    try:
        return handler(args) or 0
    except ConfigError as e:
        print(f"userrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
