"""Finds the gyms: every subpackage of `gyms` (the built-in gyms) and every module named in the entry-point group
`userrl_megatron.gyms` (gyms installed as packages of their own) is imported once, and importing a gym's module
registers it (`register_gym`). A new gym is a new folder here, or a package with such an entry point; nothing else
lists it."""

import importlib
import pkgutil
import sys
from importlib.metadata import entry_points
from pathlib import Path

ENTRY_POINT_GROUP = "userrl_megatron.gyms"  # `name = module`: importing the module registers gym(s)

_searched: list[tuple[str, ...]] = []  # the sys.path the entry points were last looked up on


def find_gyms() -> None:
    """Import every built-in gym package (in name order, so registration order is the same everywhere), then every
    installed gym's module; entry points are looked up again whenever sys.path changed."""
    for module in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if module.ispkg:
            importlib.import_module(f"gyms.{module.name}")
    if _searched == [tuple(sys.path)]:
        return
    _searched[:] = [tuple(sys.path)]
    for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            entry.load()
        except Exception as e:
            _searched.clear()  # look again next time: the error is reported each time
            raise ImportError(f"gym plug-in {entry.name} ({entry.value}, entry point {ENTRY_POINT_GROUP}): {e}") from e
