"""SearchGym tasks: the 125 Bamboogle questions (UserRL data); a test split only."""

from pathlib import Path
from typing import Any

from gyms.data import check_split, data_dir, read_json, userrl_rows, userrl_task
from gyms.search.settings import SearchGymConfig
from gyms.smoke import SmokeEpisode, by_prompt
from userrl_megatron.types import Task

QUESTIONS_JSON = "userrl/gyms/SearchGym/searchgym/data/questions.json"


def search_record(task_id: str, root: Path | None = None) -> dict[str, Any]:
    """The question record `{id, question, answer}` of `task_id`."""
    for record in read_json(root or data_dir(), QUESTIONS_JSON):
        if record["id"] == task_id:
            return record
    raise KeyError(f"SearchGym has no question {task_id!r}")


def search_tasks(split: str, root: Path) -> list[Task]:
    """UserRL's Bamboogle rows (test only)."""
    check_split("search", split, ("test",))
    rows = userrl_rows(root, "bamboogle_multiturn", "test")
    return [
        userrl_task("search", r, r["reward_model"]["id"], search_record(r["reward_model"]["id"], root)) for r in rows
    ]


def search_smoke() -> list[SmokeEpisode]:
    """Scripted episodes: a search on the empty offline corpus, the judge rejecting then an exact match; the
    search limit."""
    record = {"id": "Bamboogle-smoke", "question": "Who founded the city of Rome?", "answer": "Romulus"}
    judge = by_prompt({"You judge": ['{"reasoning": "", "judgment": "No", "feedback": "No."}']})
    return [
        SmokeEpisode(
            "search, wrong answer (judge), exact answer",
            record,
            ["[search] founder of Rome", "[answer] Remus", "[answer] romulus!"],
            [0.0, 0.0, 1.0],
            script=judge,
        ),
        SmokeEpisode(
            "search limit, then finish",
            record,
            ["[search] a", "[search] b", "[search] c", "[finish]"],
            [0.0] * 4,
            config=SearchGymConfig(max_search_steps=2, judge="exact"),
        ),
    ]
