"""`userrl`: the one command-line entry point (also `python -m userrl_megatron`).

Only argparse is imported at module level: each subcommand imports what it needs after parsing, so
`userrl --help` stays fast. Errors a user can fix (bad config, missing data) exit with status 2 and one message.
"""

import argparse
import importlib
import sys
from collections.abc import Sequence

# Command-group modules under userrl_megatron/commands/, in the order `--help` lists them.
COMMANDS = ("config", "model", "convert")


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
    args = build_parser().parse_args(argv)
    from userrl_megatron.config.loader import ConfigError
    from userrl_megatron.errors import UserError

    try:
        return args.handler(args) or 0
    except (ConfigError, UserError) as e:
        print(f"userrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
