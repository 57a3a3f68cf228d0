"""TravelGym tasks: UserRL's scenario ids and splits (8 parquet files, 2,651 train / 471 test rows), with the
scenarios generated from the ids (the scenario files are not public). The user message of each row is
regenerated to describe the generated trip; the system prompt is UserRL's."""

from pathlib import Path

from gyms.data import check_split, userrl_rows, userrl_task
from gyms.smoke import SmokeEpisode, by_prompt
from gyms.travel.generator import generate_scenario
from userrl_megatron.types import Message, Task

SUFFIXES = ("22", "33", "44", "233", "333", "334", "444", "2222")
BUDGET = (
    "Also my budget is limited so as long as my preferences are satisfied, I would also like to choose the cheapest "
    "option for each."
)


def travel_tasks(split: str, root: Path) -> list[Task]:
    """Every travel row of `split`, in UserRL's file order (22, 33, 44, 233, 333, 334, 444, 2222)."""
    check_split("travel", split)
    tasks = []
    for suffix in SUFFIXES:
        for row in userrl_rows(root, f"travel{suffix}_multiturn_onechoice", split):
            scenario_id = row["reward_model"]["id"]
            scenario = generate_scenario(scenario_id)
            task = userrl_task("travel", row, scenario_id, {"id": scenario_id})
            task.prompt[-1] = Message("user", f"{scenario['initial_description']}\n{BUDGET}")
            task.metadata["ground_truth"] = str([s["best_id"] for s in scenario["aspects"].values()])
            tasks.append(task)
    return tasks


def travel_smoke() -> list[SmokeEpisode]:
    """Scripted episodes on a generated two-aspect scenario: search, elicit, recommend the best and a correct
    option; the refusals of bad recommendations; the 5th search failing on purpose."""
    scenario_id = "hotel:2-11|restaurant:2-8"
    scenario = generate_scenario(scenario_id)
    hotel, restaurant = scenario["aspects"]["hotel"], scenario["aspects"]["restaurant"]
    other_correct = next(i for i in restaurant["correct_ids"] if i != restaurant["best_id"])
    first = scenario["preferences"][0]["id"]
    script = by_prompt(
        {
            "You check search requests": ['{"alignment_judgement": "True", "alignment_aspect": "hotel"}'] * 2
            + ['{"alignment_judgement": "False", "alignment_aspect": ""}'],
            "You classify": [f'{{"type": "2", "preference_id": "{first}"}}', '{"type": "4", "preference_id": ""}'],
            "traveller talking": ['{"thought": "", "response": "I like walking to places."}'],
        }
    )
    return [
        SmokeEpisode(
            "search, elicit, best hotel, correct restaurant",
            scenario_id,
            [
                "[search] hotel request",
                "[search] hotel request again",
                "[action] How far from the center?",
                "[action] Any preferences?",
                f"[answer] {hotel['best_id']}",
                "[search] restaurant request",
                f"[answer] {other_correct}",
            ],
            [0.0, 0.0, 0.8, 0.0, 1.0, 0.0, 0.8],
            script=script,
        ),
        SmokeEpisode(
            "bad ids, unknown aspect, a second choice for an aspect, finish",
            scenario_id,
            ["[answer] H1, R2", "[answer] hotel", "[answer] F1", "[answer] H1", "[answer] H2", "hi", "[finish]"],
            [0.0] * 7,
        ),
        SmokeEpisode(
            "every 5th search fails without asking the judge",
            scenario_id,
            ["[search] a", "[search] b", "[search] c", "[search] d", "[search] e"],
            [0.0] * 5,
            end="open",
            script=by_prompt({"You check search requests": ['{"alignment_judgement": "False"}'] * 4}),
        ),
    ]
