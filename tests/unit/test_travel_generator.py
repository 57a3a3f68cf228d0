"""TravelGym's scenario generator: structure, invariants of the options, determinism."""

import re
from pathlib import Path

import pytest

from gyms.travel.catalog import ASPECT_INITIALS
from gyms.travel.generator import COST_FIELD, _pick_kinds, generate_scenario, matches_request, parse_scenario_id
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks

IDS = [
    "flight:2-37|hotel:2-9",
    "apartment:2-39|rental_car:2-24",
    "flight:3-114|hotel:2-36|rental_car:3-65",
    "flight:4-1|apartment:4-2|rental_car:4-3|restaurant:4-4",
    "hotel:3-11|restaurant:3-8|rental_car:4-7",
]


def _all_ids(n: int) -> list[str]:
    aspects = list(ASPECT_INITIALS)
    out = []
    for i in range(n):
        chosen = [aspects[(i + k) % 5] for k in range(2 + i % 3)]
        out.append("|".join(f"{a}:{1 + (i + j) % 4}-{i * 7 + j}" for j, a in enumerate(chosen)))
    return out


@pytest.mark.parametrize("scenario_id", IDS + _all_ids(60))
def test_options_satisfy_the_contract(scenario_id: str) -> None:
    scenario = generate_scenario(scenario_id, wrong=10, noise=5)
    parsed = parse_scenario_id(scenario_id)
    assert scenario["dimensions"] == [a for a, _, _ in parsed]
    for aspect, count, piece in parsed:
        spec = scenario["aspects"][aspect]
        kinds = _pick_kinds(aspect, count, piece)
        prefs = [p for p in scenario["preferences"] if p["aspect"] == aspect]
        assert [p["preference"] for p in prefs] == [k.text for k in kinds] and len(prefs) == count
        options = {o["id"]: o for o in spec["options"]}
        initial = ASPECT_INITIALS[aspect]
        assert sorted(options, key=lambda i: int(i[1:])) == [f"{initial}{i}" for i in range(1, len(options) + 1)]
        correct = [
            i
            for i, o in options.items()
            if matches_request(aspect, o, spec["arguments"]) and all(k.check(o) for k in kinds)
        ]
        assert sorted(correct) == sorted(spec["correct_ids"]) and 2 <= len(correct) <= 4
        assert len(options) == len(correct) + 15
        cost = COST_FIELD.get(aspect, "cost")
        prices = sorted(options[i][cost] for i in correct)
        assert options[spec["best_id"]][cost] == prices[0] < prices[1]  # the best is the unique cheapest correct one
    assert [p["id"] for p in scenario["preferences"]] == [f"P{i}" for i in range(1, len(scenario["preferences"]) + 1)]


def test_same_id_same_scenario_and_pieces_fix_preferences() -> None:
    a, b = generate_scenario(IDS[0]), generate_scenario(IDS[0])
    assert a == b
    other = generate_scenario("flight:2-37|rental_car:3-1")
    assert [p["preference"] for p in a["preferences"][:2]] == [p["preference"] for p in other["preferences"][:2]]
    assert a["aspects"]["flight"]["options"] != other["aspects"]["flight"]["options"]


def test_request_and_description_agree() -> None:
    scenario = generate_scenario("flight:2-5|hotel:2-6|restaurant:2-7")
    args = {a: s["arguments"] for a, s in scenario["aspects"].items()}
    text = scenario["initial_description"]
    assert re.fullmatch(
        r"I am planning a trip to [A-Za-z ]+\. I need a one-way flight from [A-Za-z ]+ to [A-Za-z ]+ on \w+ \d+\w\w, "
        r"a hotel in [A-Za-z ]+ from \w+ \d+\w\w to \w+ \d+\w\w and a restaurant for dinner in [A-Za-z ]+ on "
        r"\w+ \d+\w\w\.",
        text,
    ), text
    assert f"from {args['flight']['origin']} to {args['flight']['destination']}" in text
    assert args["hotel"]["city"] == args["flight"]["destination"] == args["restaurant"]["city"]
    assert args["hotel"]["check_in"] == args["flight"]["date"] < args["restaurant"]["date"] < args["hotel"]["check_out"]


def test_option_counts_follow_the_config() -> None:
    scenario = generate_scenario("hotel:2-1|rental_car:2-2", wrong=3, noise=0)
    for spec in scenario["aspects"].values():
        assert len(spec["options"]) == len(spec["correct_ids"]) + 3


@pytest.mark.parametrize(
    "bad", ["flight:2-37|", "boat:2-1", "flight:9-1", "flight:2-1|flight:2-2", "flight-2-1", "restaurant:5-1"]
)
def test_bad_ids_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        generate_scenario(bad)


def test_tasks_keep_userrl_ids_and_splits(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    test = load_tasks(["travel"], "test", cfg)
    assert len(test) == 471
    task = test[0]
    scenario = generate_scenario(task.task_id)
    assert task.task_id == "apartment:2-86|rental_car:2-60"  # the first row of travel22 test, as in UserRL
    assert task.prompt[1].content == scenario["initial_description"] + (
        "\nAlso my budget is limited so as long as my preferences are satisfied, I would also like to choose the "
        "cheapest option for each."
    )
    assert task.prompt[0].content.startswith("You are an agent that actively interact with a specific environment.")
    assert task.metadata["record"] == {"id": task.task_id}
    assert task.metadata["ground_truth"] == str([s["best_id"] for s in scenario["aspects"].values()])
