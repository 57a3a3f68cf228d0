"""Task sources for training and evaluation: `load_tasks(sources, split, cfg)`.

A source is one of:
  * a gym name (`function`, `travel`, ...): that gym's tasks of the split, from the public data folder;
  * a mixture: `alltrain` or `alltest` (UserRL's data/; the mixture fixes its own split);
  * a procedural source that needs no data: `function-procedural` (FunctionGym rules from the seeded
    generator, `gyms.function.generator` settings) or `echo-procedural` (EchoGym, `gyms.echo` settings);
  * a row file path (.parquet / .jsonl): rows written by `userrl data build`, or UserRL's own parquet rows.
"""

from collections.abc import Callable
from pathlib import Path

from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.errors import UserError
from userrl_megatron.types import Task


def _function_procedural(split: str, cfg: GymsConfig) -> list[Task]:
    from gyms.function.tasks import procedural_tasks

    return procedural_tasks(split, cfg.function.generator)


def _echo_procedural(split: str, cfg: GymsConfig) -> list[Task]:
    from gyms.echo.env import echo_tasks

    return echo_tasks(split, cfg.echo)


# Sources generated from the config alone: (split, gyms config) -> tasks.
PROCEDURAL_SOURCES: dict[str, Callable[[str, GymsConfig], list[Task]]] = {
    "function-procedural": _function_procedural,
    "echo-procedural": _echo_procedural,
}


def load_tasks(sources: list[str], split: str, cfg: GymsConfig) -> list[Task]:
    """The tasks of every source for `split`, concatenated in source order. The settings of every gym they use are
    checked here, before any work starts (a plug-in gym's `gyms.plugins` entry included)."""
    from gyms import config_for
    from gyms.data import data_dir

    root = data_dir(cfg.data_dir)
    tasks: list[Task] = []
    for source in sources:
        tasks += _source_tasks(source, split, cfg, root)
    for gym in sorted({t.gym for t in tasks}):
        try:
            config_for(gym, cfg, 1)
        except (KeyError, ValueError, TypeError) as e:
            raise UserError(str(e).strip("'\"")) from e
    return tasks


def list_sources() -> list[str]:
    """Every named source (gyms, mixtures, procedural sources); row file paths are accepted too."""
    from gyms.base import list_gyms
    from userrl_megatron.data.mixtures import MIXTURES

    return [*list_gyms(), *MIXTURES, *PROCEDURAL_SOURCES]


def _source_tasks(source: str, split: str, cfg: GymsConfig, root: Path) -> list[Task]:
    from gyms.base import gym_spec, list_gyms
    from userrl_megatron.data.mixtures import MIXTURES, mixture_tasks

    if source in PROCEDURAL_SOURCES:
        return PROCEDURAL_SOURCES[source](split, cfg)
    if source in MIXTURES:
        return mixture_tasks(source, root)
    if source in list_gyms():
        spec = gym_spec(source)
        if spec.tasks is None:
            raise UserError(f"gym {source} has no task list; use a row file")
        return spec.tasks(split, root)
    path = Path(source).expanduser()
    if path.suffix in (".parquet", ".jsonl"):
        from userrl_megatron.data.rows import read_rows

        return read_rows(path, root)
    raise UserError(
        f"unknown task source {source!r}: use a gym name, a mixture, a procedural source "
        f"({', '.join(list_sources())}) or a .parquet/.jsonl row file"
    )
