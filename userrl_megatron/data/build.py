"""`userrl data build`: write every task source's rows to files, per source and split (parquet and/or jsonl).

Rows carry the gym name, task id, prompt messages, tool schemas and metadata (`userrl_megatron.data.rows`), so
training and evaluation can read them back as a row-file source, and people can inspect them.
"""

from dataclasses import dataclass
from pathlib import Path

from gyms.data import NoSuchSplitError
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.data.mixtures import MIXTURES
from userrl_megatron.data.rows import write_rows

FORMATS = ("parquet", "jsonl")


@dataclass
class Built:
    source: str
    split: str
    rows: int
    files: list[Path]


def default_sources() -> list[str]:
    """Every registered gym with public-data tasks, the procedural sources and the mixtures."""
    from gyms.base import gym_spec, list_gyms
    from userrl_megatron.data import procedural_sources

    return [g for g in list_gyms() if gym_spec(g).tasks is not None] + [*procedural_sources(), *MIXTURES]


def build_rows(
    cfg: GymsConfig, out: Path, sources: list[str] | None = None, formats: tuple[str, ...] = FORMATS
) -> list[Built]:
    """Write `<out>/<source>/<split>.<format>` for every source and each split it has."""
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        from userrl_megatron.errors import UserError

        raise UserError(f"unknown row format(s) {bad}; choose from {', '.join(FORMATS)}")
    built = []
    for source in sources or default_sources():
        splits = [MIXTURES[source][1]] if source in MIXTURES else ["train", "test"]
        for split in splits:
            try:
                tasks = load_tasks([source], split, cfg)
            except NoSuchSplitError:
                continue
            files = [write_rows(out / source / f"{split}.{fmt}", tasks, split) for fmt in formats]
            built.append(Built(source, split, len(tasks), files))
    return built
