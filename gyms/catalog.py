"""Imports every built-in gym so that its registration runs. Add new gyms here."""

import gyms.function  # noqa: F401
