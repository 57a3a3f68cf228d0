"""Errors a user can fix; the CLI prints them in one line and exits with status 2."""


class UserError(Exception):
    """A problem the user can fix (missing data, bad arguments, unreachable service)."""
