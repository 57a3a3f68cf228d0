import dataclasses
from pathlib import Path

import pytest

import gyms
from gyms.data import DataMissingError
from gyms.function.env import FunctionGym
from gyms.function.rules import Rule, generate_function, random_rule
from gyms.function.settings import FunctionGeneratorConfig, FunctionGymConfig
from gyms.function.tasks import function_record
from gyms.smoke import run_smoke
from gyms.tools import INTERACT_TOOL
from tests.support.gym_play import play, play_new
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.errors import UserError

RECORD = {"id": "t-1", "rule": "(c + b) ** 2 - a + d", "test_case": [9, 7, 4, 2], "expected_result": 114.0}


def test_gym_protocol_and_registry() -> None:
    gym = gyms.make_gym("function", RECORD)
    assert isinstance(gym, gyms.Gym) and "function" in gyms.list_gyms()
    with pytest.raises(KeyError, match="unknown gym 'nope'; known gyms: "):
        gyms.make_gym("nope", RECORD)


def test_probe_search_and_answers() -> None:
    results = play_new(
        "function",
        RECORD,
        ["[action] 1 2 3 4", "[action] 1, 2, 3.5, 4", "[search] TEST", "[answer] 113", "[answer] 114.0000001"],
    )
    assert [r.feedback for r in results] == [
        "For numbers [1.0, 2.0, 3.0, 4.0], the result is 28.0.",  # (3 + 2) ** 2 - 1 + 4; floats, as in UserRL
        "For numbers [1.0, 2.0, 3.5, 4.0], the result is 33.25.",
        "Test case: [9, 7, 4, 2]",
        "Your answer is wrong. Please continue to try and reason about the hidden function and make your answer "
        "attempt later.",
        "Your answer is correct!",
    ]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[-1].info == {"solved": True, "step": 5}


@pytest.mark.parametrize(
    ("action", "feedback"),
    [
        ("[action] 1 2", "Please provide exactly four numbers."),
        ("[action] four numbers", "Please provide exactly four numbers."),
        ("[action]", "Please provide four numbers after [action]."),
        ("[action]   ", "Please provide four numbers after [action]."),
        ("[action] 9 7 4 2", "This is the test case and I cannot provide you with the calculation feedback."),
        ("[action] 9.0 7 4 2", "This is the test case and I cannot provide you with the calculation feedback."),
        ("[search] the rule", "Search content should only be 'test' to get the test case."),
        ("[answer] forty", "Invalid numerical answer. Please provide a valid number."),
        ("[answer] 1 or 2", "Invalid numerical answer. Please provide a valid number."),
        ("[answer]", "Answer is empty. Please provide a numerical answer."),
        ("[answer]  ", "Answer is empty. Please provide a numerical answer."),
        ("[search]", "Search content should only be 'test' to get the test case."),
        ("what is it?", "Invalid action format. Please use [action], [search], [answer], or [finish]."),
        ("[think] hmm", "Invalid action format. Please use [action], [search], [answer], or [finish]."),
        ("", "Invalid action format. Please use [action], [search], [answer], or [finish]."),
    ],
)
def test_bad_actions_get_feedback_and_no_reward(action: str, feedback: str) -> None:
    (result,) = play_new("function", RECORD, [action])
    assert (result.feedback, result.reward, result.done, result.truncated) == (feedback, 0.0, False, False)


def test_answer_with_one_number_in_prose_counts() -> None:
    (result,) = play_new("function", RECORD, ["[answer] The result is 114."])
    assert (result.reward, result.done) == (1.0, True)


def test_unevaluable_probes_are_refused() -> None:
    division = {**RECORD, "rule": "a / (b - c)"}
    power = {**RECORD, "rule": "d ** a"}
    expected = (
        "Error parsing numbers or calculating result. This may happen like when division by zero occurs. "
        "Please try again with different number combinations."
    )
    assert play_new("function", division, ["[action] 1 2 2 3"])[0].feedback == expected
    assert play_new("function", power, ["[action] 999 1 1 999999"])[0].feedback == expected  # float overflow
    assert play_new("function", {**RECORD, "rule": "a ** 0.5"}, ["[action] -4 1 1 1"])[0].feedback == expected
    feedback = play_new("function", power, ["[action] 3 1 1 2"])[0].feedback
    assert feedback == "For numbers [3.0, 1.0, 1.0, 2.0], the result is 8.0."


def test_probes_are_float_arithmetic_as_in_userrl() -> None:
    """UserRL reads probe numbers with float(): huge inputs give inf, huge results inf or an overflow, never a
    500-digit exact integer (and never more than a few float operations, however long the digit strings)."""
    product = {**RECORD, "rule": "a * b * c * d"}
    big = "9" * 130
    (result,) = play_new("function", product, [f"[action] {big} {big} {big} {big}"])
    assert result.feedback == "For numbers [1e+130, 1e+130, 1e+130, 1e+130], the result is inf."
    (result,) = play_new("function", product, [f"[action] 1{'0' * 400}.5 1 1 1"])
    assert result.feedback == "For numbers [inf, 1.0, 1.0, 1.0], the result is inf."
    (result,) = play_new("function", {**RECORD, "rule": "(a - b) * c"}, [f"[action] 1{'0' * 400} 1{'0' * 400} 1 1"])
    assert result.feedback == "For numbers [inf, inf, 1.0, 1.0], the result is nan."
    (result,) = play_new("function", product, ["[action] " + "7" * 1_000_000 + " 1 1 1"])
    assert result.feedback == "For numbers [inf, 1.0, 1.0, 1.0], the result is inf."


def test_finish_reveals_the_answer_and_ends() -> None:
    results = play_new("function", RECORD, ["[finish]", "[answer] 114"])
    assert (results[0].feedback, results[0].done, results[0].reward) == (
        "Episode finished without correct answer. The expected result for the test case was: 114.0",  # UserRL's
        True,
        0.0,
    )
    assert (results[1].feedback, results[1].reward, results[1].info["error"]) == (
        "The episode has already ended; no further actions are accepted.",
        0.0,
        "episode_over",
    )


def test_reset_and_finish_texts_are_userrl_s() -> None:
    import asyncio

    gym = FunctionGym(RECORD)
    assert asyncio.run(gym.reset()) == (
        "New function problem loaded. You can use [action] with four numbers to test the function, "
        "[search] for test case, or [answer] with your final guess."
    )
    gym.solved = True  # unreachable in play (a correct answer ends the episode), as in UserRL
    assert asyncio.run(gym.act("finish", "")).feedback == "Episode finished. You answered correctly!"
    # the expected result is printed as the record stores it
    (finish,) = play_new("function", {**RECORD, "expected_result": 114}, ["[finish] now"])
    assert finish.feedback == "Episode finished without correct answer. The expected result for the test case was: 114"


def test_truncation_at_max_steps_and_reset_restarts() -> None:
    gym = FunctionGym(RECORD, FunctionGymConfig(max_steps=2))
    results = play(gym, ["[search] test", "[answer] 1", "[answer] 114"])
    assert [(r.done, r.truncated) for r in results] == [(False, False), (False, True), (True, False)]
    assert results[2].reward == 0.0  # refused: the episode was over
    again = play(gym, ["[answer] 114"])
    assert (again[0].reward, again[0].done) == (1.0, True)


def test_config_for_forces_max_steps() -> None:
    cfg = GymsConfig()
    cfg.function.generator.terms = 3
    built = gyms.config_for("function", cfg, 16)
    assert built.max_steps == 16 and built.generator.terms == 3
    assert cfg.function.max_steps == 20  # the section itself is untouched


def test_rule_evaluator_rejects_code() -> None:
    for text in ("__import__('os').system('true')", "a.real", "e + a", "a if b else c", "[a]"):
        with pytest.raises((ValueError, SyntaxError)):
            Rule(text)


def test_rule_evaluator_matches_every_userrl_record(shared_data: Path) -> None:
    import json

    records = json.loads((shared_data / "userrl/gyms/FunctionGym/functiongym/data/functions.json").read_text())
    assert len(records) == 538
    for record in records:
        assert Rule(record["rule"])(record["test_case"]) == pytest.approx(record["expected_result"], abs=1e-9)


@pytest.mark.parametrize(
    ("terms", "operators"),
    [(1, ["+"]), (2, ["+", "-"]), (3, ["*", "/"]), (4, ["+", "-", "*", "/", "**"]), (1, ["**"])],
)
def test_generator_respects_the_difficulty_knob(terms: int, operators: list[str]) -> None:
    cfg = FunctionGeneratorConfig(terms=terms, operators=operators, max_input=9)
    for i in range(40):
        record = generate_function(cfg, "train", i)
        rule = record["rule"]
        assert len({v for v in "abcd" if v in rule}) == terms
        used = {op for op in ("**", "+", "-", "*", "/") if op in rule.replace("**", "")} | (
            {"**"} if "**" in rule else set()
        )
        assert used <= set(operators), rule
        assert all(1 <= x <= 9 for x in record["test_case"])
        assert Rule(rule)(record["test_case"]) == record["expected_result"]
        assert record["expected_result"].is_integer()


def test_generator_is_seeded_and_splits_are_disjoint() -> None:
    cfg = FunctionGeneratorConfig(terms=3, operators=["+", "-", "*"])
    assert generate_function(cfg, "train", 7) == generate_function(cfg, "train", 7)
    train = [generate_function(cfg, "train", i) for i in range(30)]
    test = [generate_function(cfg, "test", i) for i in range(30)]
    other_seed = [generate_function(dataclasses.replace(cfg, seed=1), "train", i) for i in range(30)]
    key = [(r["rule"], tuple(r["test_case"])) for r in train]
    assert key != [(r["rule"], tuple(r["test_case"])) for r in test]
    assert key != [(r["rule"], tuple(r["test_case"])) for r in other_seed]
    assert train[7]["id"] == "fgen-train-0-7" and test[0]["id"] == "fgen-test-0-0"


@pytest.mark.parametrize("terms", [1, 3])
def test_balanced_tasks_make_every_input_position_score_chance(terms: int) -> None:
    cfg = FunctionGeneratorConfig(terms=terms, operators=["+", "-", "*"], balanced=True)
    records = [generate_function(cfg, "test", i) for i in range(64)]
    assert [r["rule"].lstrip("(")[0] for r in records[:8]] == list("abcdabcd")  # task i starts with input i mod 4
    for record in records:
        assert len(set(record["test_case"])) == 4, record  # distinct inputs: no position wins by coincidence
        assert Rule(record["rule"])(record["test_case"]) == record["expected_result"]
    if terms == 1:
        for position in range(4):  # "always answer input `position`" solves exactly a quarter of the tasks
            solved = sum(r["test_case"][position] == r["expected_result"] for r in records)
            assert solved == 16
    with pytest.raises(ValueError, match="max_input >= 4, not 3"):
        generate_function(dataclasses.replace(cfg, max_input=3), "test", 0)


def test_random_rule_parenthesises_by_precedence() -> None:
    import random

    rng = random.Random(3)
    for _ in range(200):
        text = random_rule(rng, 4, ["+", "-", "*", "/"])
        assert Rule(text)  # parses, and only uses a..d once each
        assert sorted(c for c in text if c in "abcd") == ["a", "b", "c", "d"]


def test_generated_ids_resolve_to_the_same_task() -> None:
    cfg = FunctionGymConfig(generator=FunctionGeneratorConfig(terms=2))
    record = generate_function(cfg.generator, "test", 5)
    assert function_record("fgen-test-0-5", cfg.generator) == record
    gym = gyms.make_gym("function", "fgen-test-0-5", config=cfg)
    results = play(gym, [f"[answer] {record['expected_result']}"])
    assert results[0].reward == 1.0


def test_procedural_source_needs_no_data(tmp_path: Path) -> None:
    cfg = GymsConfig(data_dir=str(tmp_path / "empty"))
    cfg.function.generator.tasks_per_split = 5
    tasks = load_tasks(["function-procedural"], "train", cfg)
    assert [t.task_id for t in tasks] == [f"fgen-train-0-{i}" for i in range(5)]
    task = tasks[0]
    assert [m.role for m in task.prompt] == ["system", "user"]
    assert f"The test case is {task.metadata['record']['test_case']}" in task.prompt[1].content
    assert task.tools == [INTERACT_TOOL]
    assert task.metadata["reply_without_tool_call"] == "end"
    results = play_new("function", task, [f"[answer] {task.metadata['ground_truth']}"])
    assert results[0].reward == 1.0


def test_function_tasks_from_public_data(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train, test = load_tasks(["function"], "train", cfg), load_tasks(["function"], "test", cfg)
    assert (len(train), len(test)) == (460, 78)
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    task = train[0]
    assert task.task_id == "func-486" and task.metadata["ground_truth"] == "-16.0"
    assert task.metadata["record"] == {
        "id": "func-486",
        "rule": "(a - d) - b - c",
        "test_case": [5, 8, 7, 6],
        "expected_result": -16.0,
    }
    assert task.prompt[0].content.startswith("You are an agent that actively interact with a specific environment.")
    assert play_new("function", task, ["[answer] -16"])[0].reward == 1.0


def test_missing_data_names_the_fetch_command(tmp_path: Path) -> None:
    cfg = GymsConfig(data_dir=str(tmp_path))
    with pytest.raises(DataMissingError) as e:
        load_tasks(["function"], "train", cfg)
    assert str(e.value) == (
        f"userrl/gyms/FunctionGym/functiongym/data/functions.json is missing from the data folder {tmp_path}: "
        "run `userrl data fetch` (or `userrl data fetch --from DIR` to copy a local copy of the data)"
    )


def test_unknown_source_and_split() -> None:
    with pytest.raises(UserError, match="unknown task source 'functon': use a gym name"):
        load_tasks(["functon"], "train", GymsConfig())
    with pytest.raises(UserError, match="gym function-procedural has no 'dev' split; its splits: train, test"):
        load_tasks(["function-procedural"], "dev", GymsConfig())


def test_smoke_episodes_pass() -> None:
    results = run_smoke(["function"])
    assert [r.ok for r in results] == [True, True], [r.problem for r in results]
    assert [r.total_reward for r in results] == [1.0, 0.0]
