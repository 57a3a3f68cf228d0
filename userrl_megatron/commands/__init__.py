"""`userrl` subcommands, one module per command group.

Each module exposes `register(subparsers)`, which adds its parser(s) and sets `handler` to a function taking the
parsed arguments and returning an exit status. Modules import only argparse at module level; handlers import
the heavy machinery they need, so `userrl --help` stays fast.
"""
