"""PersuadeGym tasks. UserRL's statements file is not public: the 420 (claim, argument) records are recovered from
the parquet rows (378 train / 42 test), keyed by their 12-character id."""

from pathlib import Path
from typing import Any

from gyms.data import check_split, data_dir, userrl_rows, userrl_task
from gyms.smoke import SmokeEpisode, by_prompt
from userrl_megatron.types import Task


def persuade_record(task_id: str, root: Path | None = None) -> dict[str, Any]:
    """The statement record `{id, claim, argument}` of `task_id`, from either split."""
    root = root or data_dir()
    for split in ("train", "test"):
        for row in userrl_rows(root, "persuasion_multiturn", split):
            if row["reward_model"]["id"] == task_id:
                return _record(row)
    raise KeyError(f"PersuadeGym has no statement {task_id!r}")


def persuade_tasks(split: str, root: Path) -> list[Task]:
    """UserRL's persuasion rows of `split`."""
    check_split("persuade", split)
    rows = userrl_rows(root, "persuasion_multiturn", split)
    return [userrl_task("persuade", row, row["reward_model"]["id"], _record(row)) for row in rows]


def _record(row: dict[str, Any]) -> dict[str, Any]:
    rm = row["reward_model"]
    return {"id": rm["id"], "claim": rm["claim"], "argument": rm["argument"]}


def persuade_smoke() -> list[SmokeEpisode]:
    """Scripted episodes: the stance moves 0 -> 2 -> 1 -> 4 -> 6 (paid from the best stance: 1/3, 0, 1/3, 1/3)."""
    record = {"id": "SMOKE0000001", "claim": "Cats are better than dogs.", "argument": "Cats are independent."}
    stances = ["Partly Agree", "Agree", "Partly Disagree", "Strongly Disagree"]
    script = by_prompt({"debate": [f'{{"thought": "", "response": "Hm.", "stance": "{s}"}}' for s in stances]})
    return [
        SmokeEpisode(
            "stance climbs to Strongly Disagree",
            record,
            ["[answer] Dogs help people.", "[answer] Dogs are loyal.", "Dogs save lives.", "[answer] Science says"],
            [0.333333, 0.0, 0.333333, 0.333333],
            script=script,
        ),
        SmokeEpisode("finish", record, ["[finish]"], [0.0]),
    ]
