"""Imports every built-in gym so that its registration runs. Add new gyms here."""

import gyms.echo
import gyms.function
import gyms.intention
import gyms.persuade
import gyms.search
import gyms.tau
import gyms.telepathy
import gyms.travel
import gyms.turtle  # noqa: F401
