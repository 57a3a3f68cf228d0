"""Task sources for training and evaluation: `load_tasks(sources, split, cfg)`.

A source is one of:
  * a gym name (`function`, `travel`, ...): that gym's tasks of the split, from the public data folder;
  * a gym name and a split (`tau2_retail:train`, `tau2_airline:base`): that split, whichever split is asked for;
  * a mixture: `alltrain` or `alltest` (UserRL's data/; the mixture fixes its own split);
  * a procedural source that needs no data, which a gym registers with the settings it is made from
    (`procedural_sources()`: `function-procedural`, FunctionGym rules from `gyms.function.generator`, and
    `echo-procedural`, from `gyms.echo`);
  * a row file path (.parquet / .jsonl): rows written by `userrl data build`, or UserRL's own parquet rows.
"""

from pathlib import Path

from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.errors import UserError
from userrl_megatron.types import Task


def load_tasks(sources: list[str], split: str, cfg: GymsConfig) -> list[Task]:
    """The tasks of every source for `split`, concatenated in source order."""
    from gyms.base import gym_spec
    from gyms.data import data_dir

    root = data_dir(cfg.data_dir)
    tasks: list[Task] = []
    for source in sources:
        tasks += _source_tasks(source, split, cfg, root)
    for gym in sorted({t.gym for t in tasks}):
        try:
            gym_spec(gym)
        except KeyError as e:
            raise UserError(str(e).strip("'\"")) from e
    return tasks


def list_sources() -> list[str]:
    """Every named source (gyms, mixtures, procedural sources); row file paths are accepted too."""
    from gyms.base import list_gyms
    from userrl_megatron.data.mixtures import MIXTURES

    return [*list_gyms(), *MIXTURES, *procedural_sources()]


def procedural_sources() -> dict[str, str]:
    """Source -> the gym that generates it from its settings alone (`register_gym(..., procedural=...)`)."""
    from gyms.base import gym_spec, list_gyms

    return {source: gym for gym in list_gyms() for source in sorted(gym_spec(gym).procedural)}


def _source_tasks(source: str, split: str, cfg: GymsConfig, root: Path) -> list[Task]:
    from gyms import config_for
    from gyms.base import gym_spec, list_gyms
    from userrl_megatron.data.mixtures import MIXTURES, mixture_tasks

    gym, colon, named = source.partition(":")
    if colon and named and gym in list_gyms():  # `<gym>:<split>`: that split of the gym, whichever is asked for
        source, split = gym, named
    procedural = procedural_sources()
    if source in procedural:
        spec = gym_spec(procedural[source])
        return spec.procedural[source](split, config_for(spec.name, cfg, 1))
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
