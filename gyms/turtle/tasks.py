"""TurtleGym tasks: 471 stories (UserRL data) looked up by title; parquet splits 423 / 48."""

import json
from pathlib import Path
from typing import Any

from gyms.data import check_split, data_dir, read_json, userrl_rows, userrl_task
from gyms.smoke import SmokeEpisode, by_prompt
from userrl_megatron.types import Task

STORIES_JSON = "userrl/gyms/TurtleGym/turtlegym/data/all_stories_refined.json"


def turtle_record(title: str, root: Path | None = None) -> dict[str, Any]:
    """The story titled `title` (case-insensitive) among the stories judged usable ("judgment": "Yes")."""
    key = title.strip().lower()
    for record in read_json(root or data_dir(), STORIES_JSON).values():
        if record.get("judgment") == "Yes" and record["new_title"].lower() == key:
            return record
    raise KeyError(f"TurtleGym has no story titled {title!r}")


def turtle_tasks(split: str, root: Path) -> list[Task]:
    """UserRL's turtle rows of `split`; the task id is the story title (as in UserRL)."""
    check_split("turtle", split)
    tasks = []
    for row in userrl_rows(root, "turtle_multiturn", split):
        title = row["reward_model"]["title"]
        tasks.append(userrl_task("turtle", row, title, turtle_record(title, root)))
    return tasks


def turtle_smoke() -> list[SmokeEpisode]:
    """Scripted episodes: a question, a partial story (0.3), a better one (0.8 -> +0.5), the full one (+0.2)."""
    record = {
        "new_title": "The Broken Nails",
        "new_surface": "Her nails were found broken on the floor.",
        "new_bottom": "She was left for dead, woke up hanged, clawed at the rope and died.",
        "evaluation": [
            {"statement": "She was left for dead by someone", "score": 0.4},
            {"statement": "She woke up and clawed at the rope", "score": 0.6},
        ],
    }

    def graded(first: float, second: float) -> str:
        scores = [{"statement": s, "thought": "", "score": v} for s, v in (("a", first), ("b", second))]
        return json.dumps({"scores": scores, "feedback": "ok"})

    script = by_prompt(
        {
            "You host": ['{"thought": "", "response": "Yes"}'],
            "You grade": [graded(0.0, 0.5), graded(0.5, 1.0), graded(1.0, 1.0)],
        }
    )
    return [
        SmokeEpisode(
            "question, then stories scoring 0.3, 0.8, 1.0",
            record,
            ["[action] Did she die?", "[answer] She fought a rope.", "[answer] Left for dead...", "[answer] Full"],
            [0.0, 0.3, 0.5, 0.2],
            script=script,
        ),
        SmokeEpisode("finish", record, ["[finish]"], [0.0]),
    ]
