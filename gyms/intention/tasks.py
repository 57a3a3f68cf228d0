"""IntentionGym tasks: 1,107 vague requests (UserRL's train and test files together), parquet splits 380 / 40."""

from functools import cache
from pathlib import Path
from typing import Any

from gyms.data import check_split, data_dir, read_json, userrl_rows, userrl_task
from gyms.smoke import SmokeEpisode, by_prompt
from userrl_megatron.types import Task

INTENTION_FILES = (
    "userrl/gyms/IntentionGym/intentiongym/data/all_intentions_train.json",
    "userrl/gyms/IntentionGym/intentiongym/data/all_intentions_test.json",
)


def intention_record(task_id: str, root: Path | None = None) -> dict[str, Any]:
    """The request record `{id, category, task, missing_details}` of `task_id`."""
    records = _by_id((root or data_dir()).resolve())
    if task_id not in records:
        raise KeyError(f"IntentionGym has no task {task_id!r}")
    return records[task_id]


def intention_tasks(split: str, root: Path) -> list[Task]:
    """UserRL's intention rows of `split`."""
    check_split("intention", split)
    rows = userrl_rows(root, "intention_multiturn", split)
    return [
        userrl_task("intention", r, r["reward_model"]["id"], intention_record(r["reward_model"]["id"], root))
        for r in rows
    ]


@cache
def _by_id(root: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for path in INTENTION_FILES for r in read_json(root, path)}


def intention_smoke() -> list[SmokeEpisode]:
    """Scripted episodes: one detail (HIGH), two at once (MEDIUM + LOW: 0.7 - 0.2), an off-topic question, the
    last detail (LOW) which ends the episode: rewards 1.0, 0.5, 0, 0.4."""
    record = {
        "id": "smoke-intention",
        "category": "Travel",
        "task": "Plan a trip to Paris.",
        "missing_details": [
            {"description": "Trip length", "importance": "3", "inquiry": "How long?", "options": ["3 days"]},
            {"description": "Budget", "importance": "2", "inquiry": "Budget?", "options": ["Mid-range"]},
            {"description": "Food", "importance": "1", "inquiry": "Diet?", "options": ["Vegan"]},
            {"description": "Hotel", "importance": "1", "inquiry": "Hotel?", "options": ["Boutique"]},
        ],
    }
    answers = ['{"thought": "", "response": "Sure."}'] * 4
    coverage = [
        '{"analysis": "", "is_task_related": true, "covered_detail_numbers": [1]}',
        '{"analysis": "", "is_task_related": true, "covered_detail_numbers": [1, 2, 9]}',  # budget + food; 9: none
        '{"analysis": "", "is_task_related": false, "covered_detail_numbers": [1]}',
        '{"analysis": "", "is_task_related": true, "covered_detail_numbers": ["1"]}',
    ]
    return [
        SmokeEpisode(
            "cover every detail",
            record,
            ["[action] How long?", "[action] Budget and diet?", "Weather?", "[answer] Which hotel?"],
            [1.0, 0.5, 0.0, 0.4],
            script=by_prompt({"You play": answers, "You judge": coverage}),
        ),
        SmokeEpisode("finish", record, ["[finish]"], [0.0]),
    ]
