"""TelepathyGym tasks: 401 entities (UserRL data), looked up by title or id; parquet splits 360 / 41."""

from pathlib import Path
from typing import Any

from gyms.data import check_split, data_dir, read_json, userrl_rows, userrl_task
from gyms.smoke import SmokeEpisode, by_prompt
from userrl_megatron.types import Task

ENTITIES_JSON = "userrl/gyms/TelepathyGym/telepathygym/data/all_entities_refined.json"


def telepathy_record(key: str, root: Path | None = None) -> dict[str, Any]:
    """The entity whose title or id is `key` (case-insensitive)."""
    key = key.strip().lower()
    for record in read_json(root or data_dir(), ENTITIES_JSON):
        if key in (record["title"].lower(), record["id"].lower()):
            return record
    raise KeyError(f"TelepathyGym has no entity {key!r}")


def telepathy_tasks(split: str, root: Path) -> list[Task]:
    """UserRL's telepathy rows of `split`; the task id is the entity title (as in UserRL)."""
    check_split("telepathy", split)
    tasks = []
    for row in userrl_rows(root, "telepathy_multiturn", split):
        title = row["reward_model"]["title"]
        tasks.append(userrl_task("telepathy", row, title, telepathy_record(title, root)))
    return tasks


def telepathy_smoke() -> list[SmokeEpisode]:
    """Scripted episodes: questions, a wrong then a right guess (which ends the game); finish."""
    record = {
        "id": "entity_smoke",
        "title": "Kiwi",
        "description": "I am thinking of a fruit.",
        "target_entity": "Kiwi - a small fuzzy brown fruit with green flesh",
        "category": "food",
    }
    script = by_prompt(
        {
            "game master": ['{"thought": "it is a fruit", "response": "Yes"}', '{"response": "No"}'],
            "judge": [
                '{"thought": "no", "judgment": "No", "feedback": "Not quite."}',
                '```json\n{"thought": "yes", "judgment": "Yes", "feedback": "Well done!"}\n```',
            ],
        }
    )
    return [
        SmokeEpisode(
            "questions, wrong then right guess",
            record,
            ["[action] Is it a fruit?", "Is it red?", "[answer] apple", "[answer] kiwi fruit"],
            [0.0, 0.0, 0.0, 1.0],
            script=script,
        ),
        SmokeEpisode("finish", record, ["[finish]"], [0.0]),
    ]
