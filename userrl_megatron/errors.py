"""Errors a user can fix; the CLI prints them in one line and exits with status 2."""


class UserError(Exception):
    """A problem the user can fix (missing data, bad arguments, unreachable service)."""


class RunError(Exception):
    """The run cannot go on (no rollout engine left, a checkpoint that cannot be written or read): the CLI
    prints it in one line and exits with status 1; the last good checkpoint is left as it was."""
