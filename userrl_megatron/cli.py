"""`userrl`: the one command-line entry point (also `python -m userrl_megatron`).

Only argparse is imported at module level: each subcommand imports what it needs after parsing, so
`userrl --help` stays fast. Errors a user can fix (bad config, missing data) exit with status 2 and one message;
a run that cannot go on (`RunError`: no engine left, a checkpoint that cannot be written) exits with status 1.
"""

import argparse
import importlib
import sys
from collections.abc import Sequence

# Command-group modules under userrl_megatron/commands/, in the order `--help` lists them.
COMMANDS = ("config", "model", "data", "gym", "rollout", "serve", "train", "sft", "eval", "plan", "convert")


def build_parser() -> argparse.ArgumentParser:
    """The full `userrl` argument parser."""
    parser = argparse.ArgumentParser(
        prog="userrl", description="Multi-turn, user-centric RL: Megatron-core actors, SGLang rollout, UserRL gyms."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"userrl_megatron.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse cannot match `key=value` overrides given after an option that follows another positional
    # (`gym play NAME --task ID key=value`): collect them here.
    if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in e[1:] for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from userrl_megatron.config.loader import ConfigError
    from userrl_megatron.errors import RunError, UserError

    try:
        return args.handler(args) or 0
    except ConfigError as e:
        for problem in e.problems:
            print(f"userrl: error: {problem}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"userrl: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"userrl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
