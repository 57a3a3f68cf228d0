"""Where the public gym data lives and how gyms read it (read-only, cached per file).

The data folder has the layout of `shared/data` and of the `userrl data fetch` cache: `userrl/...` (UserRL's
parquet rows and gym JSON files at their repository paths) and `taubench/...`. A missing file is a
DataMissingError that names the command fetching it.
"""

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

from userrl_megatron.errors import UserError
from userrl_megatron.types import Message, Task

DATA_DIR_ENV = "USERRL_DATA_DIR"
FETCH_HINT = "run `userrl data fetch` (or `userrl data fetch --from DIR` to copy a local copy of the data)"


class DataMissingError(UserError):
    """A public data file is not in the data folder."""


class NoSuchSplitError(UserError):
    """A task source has no such split (e.g. SearchGym has no train split)."""


def data_dir(configured: str | Path = "") -> Path:
    """The data folder: `configured` (gyms.data_dir), else $USERRL_DATA_DIR, else `<cache>/data`."""
    if str(configured):
        return Path(configured).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    from userrl_megatron.model_store import cache_root

    return cache_root() / "data"


def require(root: Path, relpath: str) -> Path:
    """`root / relpath`, or a DataMissingError saying how to get it."""
    path = root / relpath
    if not path.is_file():
        raise DataMissingError(f"{relpath} is missing from the data folder {root}: {FETCH_HINT}")
    return path


def read_json(root: Path, relpath: str) -> Any:
    """A JSON data file (parsed once per process)."""
    return _read_json(require(root, relpath).resolve())


def userrl_rows(root: Path, folder: str, split: str) -> list[dict[str, Any]]:
    """UserRL's parquet rows `userrl/data/<folder>/<split>.parquet` as dictionaries (read once per process)."""
    return _read_parquet(require(root, f"userrl/data/{folder}/{split}.parquet").resolve())


def userrl_task(gym: str, row: dict[str, Any], task_id: str, record: dict[str, Any]) -> Task:
    """A Task from one UserRL parquet row: its system + user prompt, the interact tool, the gym's record."""
    from gyms.tools import INTERACT_TOOL

    reward_model = row.get("reward_model") or {}
    return Task(
        gym=gym,
        task_id=task_id,
        prompt=[Message(role=m["role"], content=m["content"]) for m in row["prompt"]],
        tools=[INTERACT_TOOL],
        metadata={
            "record": record,
            "ground_truth": reward_model.get("ground_truth", ""),
            "data_source": row.get("data_source", ""),
            "reply_without_tool_call": "end",
        },
    )


def userrl_row_key(row: dict[str, Any]) -> tuple[str, str]:
    """(env_name, task id or title) of a UserRL row: what identifies its task inside its gym."""
    reward_model = row.get("reward_model") or {}
    return reward_model.get("env_name", ""), str(reward_model.get("id") or reward_model.get("title") or "")


def check_split(gym: str, split: str, splits: tuple[str, ...] = ("train", "test")) -> None:
    """UserError unless `split` is one of the gym's splits."""
    if split not in splits:
        raise NoSuchSplitError(f"gym {gym} has no {split!r} split; its splits: {', '.join(splits)}")


@cache
def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@cache
def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
