"""Finds the gyms: every subpackage of `gyms` is imported once, and importing a gym's package registers it
(`register_gym`). A new gym is a new folder here; nothing else lists it."""

import importlib
import pkgutil
from pathlib import Path


def import_gym_packages() -> None:
    """Import every gym package under `gyms/` (in name order, so registration order is the same everywhere)."""
    for module in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if module.ispkg:
            importlib.import_module(f"gyms.{module.name}")
