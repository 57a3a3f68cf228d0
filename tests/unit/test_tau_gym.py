"""The tau gyms with scripted actions: task ids and rows, every action path, the reward rules, fresh DBs.

The paths that reach the simulated customer run over real HTTP in test_tau_user_sim.py.
"""

import json

import pytest

from gyms.base import make_gym
from gyms.smoke import ScriptedUserSim
from gyms.tau.domain import load_domain
from gyms.tau.gym import HELP, INVALID_TOOL_CALL, TOOLS_ALREADY_LISTED, parse_tool_call
from gyms.tau.settings import TauGymConfig
from gyms.tau.store import db_hash
from gyms.tau.tasks import format_task_id, parse_task_id
from gyms.tools import INTERACT_TOOL
from gyms.turn_gym import EPISODE_OVER
from tests.support.gym_play import play
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.errors import UserError


@pytest.fixture(scope="module")
def cfg(shared_data):
    return TauGymConfig(data_dir=str(shared_data))


def _unexpected_call(messages):
    pytest.fail("these actions must not reach the simulated customer")


def _gym(name, task, config):
    """A gym whose customer must stay silent (the paths reaching it are tested over HTTP in test_tau_user_sim.py)."""
    return make_gym(name, task, config=config, user_sim=ScriptedUserSim(_unexpected_call))


def _answer(name, **arguments):
    return "[answer] " + json.dumps({"name": name, "arguments": arguments})


def _gold_answers(shared_data, task_id):
    domain, split, index = parse_task_id(task_id)
    task = load_domain(domain, str(shared_data / "taubench")).task(split, index)
    return [_answer(a["name"], **a["kwargs"]) for a in task.actions]


@pytest.mark.parametrize(
    ("task_id", "parsed", "canonical"),
    [
        ("retail-007", ("retail", "test", 7), "retail-007"),
        ("retail-test-7", ("retail", "test", 7), "retail-007"),
        ("Retail-Train-123", ("retail", "train", 123), "retail-train-123"),
        ("airline-049", ("airline", "test", 49), "airline-049"),
    ],
)
def test_task_ids(task_id, parsed, canonical):
    assert parse_task_id(task_id) == parsed
    assert format_task_id(*parsed) == canonical


@pytest.mark.parametrize(
    ("task_id", "message"),
    [
        (
            "retail-7x",
            "not a tau task id: 'retail-7x' (expected e.g. 'retail-007', 'retail-train-007' or 'airline-012')",
        ),
        ("airline-train-001", "tau task 'airline-train-001': airline has no train split"),
        ("retail-dev-001", "not a tau task id: 'retail-dev-001'"),
    ],
)
def test_bad_task_ids_are_named(task_id, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_task_id(task_id)


def test_tau_rows_are_userrl_taugym_rows(shared_data):
    gyms_cfg = GymsConfig(data_dir=str(shared_data))
    train, test = load_tasks(["tau"], "train", gyms_cfg), load_tasks(["tau"], "test", gyms_cfg)
    assert (len(train), len(test)) == (500, 165)
    assert train[7].task_id == "retail-train-007" and test[-1].task_id == "airline-049"
    first = test[0]
    assert first.gym == "tau" and first.tools == [INTERACT_TOOL]
    assert first.prompt[0].content.startswith("You are an agent that actively interact with a specific environment.")
    opening = "Hello! I recently received an order and want to make a couple of exchanges. Can you help me with that?"
    assert first.prompt[1].content.startswith(f"Here is my request: {opening}\n")
    record = first.metadata["record"]
    assert {k: record[k] for k in ("id", "domain", "split", "index", "opening")} == {
        "id": "retail-000",
        "domain": "retail",
        "split": "test",
        "index": 0,
        "opening": opening,
    }
    assert first.metadata["reply_without_tool_call"] == "end"


def test_domain_rows_use_the_policy_and_native_tools(shared_data):
    gyms_cfg = GymsConfig(data_dir=str(shared_data))
    retail_train = load_tasks(["tau_retail"], "train", gyms_cfg)
    both = load_tasks(["tau_retail", "tau_airline"], "test", gyms_cfg)
    retail_test, airline_test = both[:115], both[115:]
    assert (len(retail_train), len(retail_test), len(airline_test)) == (500, 115, 50)
    row = airline_test[13]
    assert row.gym == "tau_airline" and row.task_id == "airline-013"
    assert row.prompt[0].content == (shared_data / "taubench/airline/policy.md").read_text()
    assert row.prompt[1].content == row.metadata["record"]["opening"]
    assert [t["function"]["name"] for t in row.tools] == [
        t["function"]["name"] for t in json.loads((shared_data / "taubench/airline/tools.json").read_text())
    ]
    assert len(retail_test[0].tools) == 16 and len(row.tools) == 14
    assert row.metadata["reply_without_tool_call"] == "action"
    with pytest.raises(UserError, match="gym tau_airline has no 'train' split; its splits: test"):
        load_tasks(["tau_airline"], "train", gyms_cfg)


def test_userrl_mixture_resolves_tau_rows_to_the_tau_gym(shared_data):
    from userrl_megatron.data.mixtures import mixture_tasks

    tau = [t for t in mixture_tasks("alltest", shared_data) if t.metadata.get("data_source") == "interact_taugym"]
    assert len(tau) == 82 and {t.gym for t in tau} == {"tau"}


def test_make_gym_from_an_id_a_record_or_a_task(shared_data, cfg):
    task = load_tasks(["tau_retail"], "test", GymsConfig(data_dir=str(shared_data)))[3]
    for source in ("retail-003", task.metadata["record"], task):
        gym = _gym("tau_retail", source, cfg)
        assert gym.task.index == 3 and gym.opening == task.prompt[1].content
    with pytest.raises(ValueError, match="gym tau_retail runs retail tasks, got 'airline-001'"):
        _gym("tau_retail", "airline-001", cfg)


def test_search_tools_help_and_unsupported(cfg, shared_data):
    gym = _gym("tau", "airline-000", cfg)
    results = play(gym, ["[search] tools", "[search] TOOLS", "[search] help", "[search] weather"])
    tools = results[0].feedback.splitlines()
    assert tools[:5] == [
        "Available Tools:",
        "- book_reservation: Book a reservation.",
        "  Parameters:",
        "    - user_id: The ID of the user to book the reservation, such as 'sara_doe_496'.",
        "    - origin: The IATA code for the origin city, such as 'SFO'.",
    ]
    assert sum(line.startswith("- ") for line in tools) == 14
    assert "- list_all_airports: List all airports and their cities." in tools
    assert results[1].feedback == TOOLS_ALREADY_LISTED
    assert results[2].feedback == HELP
    assert results[3].feedback == (
        "Search not supported for 'weather'. Please search for available tools by providing 'tools' in content or "
        "show help information by providing 'help' in content."
    )
    assert [(r.reward, r.done, r.truncated, r.info["step"]) for r in results] == [
        (0.0, False, False, i) for i in (1, 2, 3, 4)
    ]


@pytest.mark.parametrize(
    ("content", "parsed"),
    [
        ('{"name": "think", "arguments": {"thought": "x"}}', ("think", {"thought": "x"})),
        ('think: {"thought": "x"}', ("think", {"thought": "x"})),
        ('{"name": "list_all_airports"}', ("list_all_airports", {})),
        ("think", None),
        ("{not json}", None),
        ('{"name": "think", "arguments": "{\\"thought\\": 1}"}', None),
        ('{"name": 5, "arguments": {}}', None),
        ('think {"thought": "x"}', None),  # UserRL's README form without a colon
    ],
)
def test_parse_tool_call(content, parsed):
    assert parse_tool_call(content) == parsed


def test_answer_paths(cfg):
    gym = _gym("tau", "retail-000", cfg)
    results = play(
        gym,
        [
            _answer("find_user_id_by_name_zip", first_name="Yusuf", last_name="Rossi", zip="19122"),
            'find_user_id_by_email: {"email": "nobody@example.com"}',
            "[answer] find_user_id_by_email",
            _answer("drop_table"),
            _answer("cancel_pending_order", order_id="#W1"),
            "[answer]   think: {}",
        ],
    )
    assert [r.feedback for r in results] == [
        "yusuf_rossi_9620",
        'Invalid action format: find_user_id_by_email: {"email": "nobody@example.com"}. Please follow the '
        "system instruction to call the interact tool.",
        INVALID_TOOL_CALL,
        "Unknown action drop_table",
        "Error: CancelPendingOrder.invoke() missing 1 required positional argument: 'reason'",
        "Error: Think.invoke() missing 1 required positional argument: 'thought'",
    ]
    assert all(r.reward == 0.0 and not r.ended for r in results)


def test_finish_ends_with_zero_and_later_steps_are_refused(cfg, shared_data):
    gym = _gym("tau", "retail-000", cfg)
    results = play(gym, [*_gold_answers(shared_data, "retail-000"), "[finish]", "[search] tools"])
    finish, after = results[-2], results[-1]
    assert (finish.feedback, finish.reward, finish.done) == ("Episode finished. Final reward: 0.0", 0.0, True)
    assert (after.feedback, after.reward, after.done) == (EPISODE_OVER, 0.0, True)


def test_transfer_ends_the_episode_with_the_task_reward(cfg, shared_data):
    gold = _gold_answers(shared_data, "airline-013")
    assert json.loads(gold[-1][len("[answer] ") :])["name"] == "transfer_to_human_agents"
    solved = play(_gym("tau_airline", "airline-013", cfg), gold)
    assert [r.reward for r in solved] == [0.0] * (len(gold) - 1) + [1.0]
    assert solved[-1].feedback == "Transfer successful" and solved[-1].done
    assert solved[-1].info["reward_info"]["r_actions"] == 1.0
    wrong = play(
        _gym("tau_airline", "airline-013", cfg),
        [_answer("send_certificate", user_id="mei_hernandez_8984", amount=100), gold[-1]],
    )
    assert (wrong[-1].reward, wrong[-1].done, wrong[-1].info["reward_info"]["r_actions"]) == (0.0, True, 0.0)


def test_step_limit_truncates(cfg):
    gym = _gym("tau", "retail-000", TauGymConfig(max_steps=3, data_dir=cfg.data_dir))
    results = play(gym, ["[search] help"] * 4)
    assert [(r.done, r.truncated) for r in results] == [(False, False), (False, False), (False, True), (True, False)]
    assert results[-1].feedback == EPISODE_OVER


def test_domain_gyms_have_no_search_and_open_with_the_customer(cfg):
    gym = _gym("tau_retail", "retail-train-004", cfg)
    results = play(gym, ["[search] tools", "hello", "[finish]"])
    assert results[0].feedback == (
        "Invalid action: [search] tools. Call one of the tools, or write a message to the customer."
    )
    assert results[1].feedback == "Invalid action: hello. Call one of the tools, or write a message to the customer."
    assert results[2].done
    assert _gym("tau", "retail-train-004", cfg).observation() == "User says: " + gym.opening


def test_each_episode_gets_a_fresh_database(cfg):
    first = _gym("tau_retail", "retail-000", cfg)
    cancel = _answer("cancel_pending_order", order_id="#W8955613", reason="no longer needed")
    assert json.loads(play(first, [cancel])[0].feedback)["status"] == "cancelled"
    second = _gym("tau_retail", "retail-000", cfg)
    assert second.db.hash() == second.domain.base.hash() != first.db.hash()
    replayed = play(second, [cancel])  # play() resets, and reset gives a fresh database too
    assert json.loads(replayed[0].feedback)["status"] == "cancelled"
    assert second.domain.base.tables["orders"]["#W8955613"]["status"] == "pending"


def test_reward_rules(shared_data):
    retail = load_domain("retail", str(shared_data / "taubench"))

    def score(task_index, said, change=True):
        task = retail.task("test", task_index)
        db = retail.new_db()
        if change:
            retail.replay(task.actions, db)
        return retail.score(task, db, said)

    assert score(24, ["We have POLYESTER and Cotton."]).reward == 1.0  # case-insensitive
    partial = score(24, ["polyester only"])
    assert (partial.reward, partial.outputs, partial.info()["r_outputs"]) == (
        0.0,
        {"polyester": True, "cotton": False},
        0.0,
    )
    assert score(16, ["The total is $8,276.23."]).reward == 1.0  # commas removed from the message
    assert score(16, ["8276.2"]).reward == 0.0
    wrong_db = score(16, ["8276.23"], change=False)  # the right words, but the return was not made
    assert (wrong_db.reward, wrong_db.db_match, wrong_db.outputs) == (0.0, False, {"8276.23": True})
    no_outputs = score(0, [])
    assert no_outputs.reward == 1.0 and no_outputs.info() == {"r_actions": 1.0, "gt_data_hash": no_outputs.gold_hash}


@pytest.mark.parametrize("gym_name", ["tau_retail", "tau_airline"])
def test_hostile_tool_arguments_never_raise_and_never_touch_the_base(cfg, gym_name):
    """Every tool, every parameter given each JSON type: an observation string, the shared base unchanged."""
    gym = _gym(gym_name, "retail-000" if gym_name == "tau_retail" else "airline-000", cfg)
    pristine = db_hash(gym.domain.base.tables)
    actions = []
    for schema in gym.domain.schemas:
        name, params = schema["function"]["name"], list(schema["function"]["parameters"]["properties"])
        for param in params:
            for value in (None, 5, -1.5, True, [], [None], {}, {"a": 1}, "x", ""):
                actions.append(_answer(name, **{p: value if p == param else "x" for p in params}))
        actions.append(_answer(name, **{p: "x" for p in params}, unexpected=1))
    results = []
    for start in range(0, len(actions), 25):  # a fresh episode every 25 calls (the step limit)
        results += play(gym, [a for a in actions[start : start + 25] if "transfer_to_human_agents" not in a])
    assert len(results) > 300
    assert all(isinstance(r.feedback, str) and r.reward == 0.0 for r in results)
    assert sum(r.feedback.startswith("Error: ") for r in results) > len(results) // 2
    assert db_hash(gym.domain.base.tables) == pristine


def test_respond_tool_call_is_a_message_to_the_customer(cfg, shared_data):
    """tau-bench's `respond` action as a tool call: the customer answers, and it counts toward the outputs."""
    heard = []

    def customer(messages):
        heard.append(messages[-1]["content"])
        return "###STOP###" if "8,276.23" in messages[-1]["content"] else "Go on."

    for gym_name in ("tau", "tau_retail"):
        heard.clear()
        gym = make_gym(gym_name, "retail-016", config=cfg, user_sim=ScriptedUserSim(customer))
        gold = _gold_answers(shared_data, "retail-016")
        results = play(gym, [*gold, _answer("respond", content="Hello?"), _answer("respond", content="$8,276.23")])
        assert heard == ["Hello?", "$8,276.23"]
        assert results[-2].feedback == "Go on." and results[-2].reward == 0.0
        assert (results[-1].feedback, results[-1].reward, results[-1].done) == ("###STOP###", 1.0, True)
        assert results[-1].info["reward_info"]["outputs"] == {"8276.23": True}


def test_respond_without_a_string_content_changes_nothing(cfg):
    gym = _gym("tau", "retail-016", cfg)
    results = play(gym, [_answer("respond"), _answer("respond", content=["hi"]), _answer("respond", text="hi")])
    assert [r.feedback for r in results] == ["Error executing tool call: 'content'"] * 3
    assert all(r.reward == 0.0 and not r.ended for r in results)
    assert gym.said == [] and len(gym.customer.history) == 3


@pytest.mark.parametrize(
    "content",
    [
        '{"name": "think", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}",  # deeper than the JSON reader goes
        'think: {"thought": ' + "7" * 5_000 + "}",  # over Python's 4,300-digit limit
        'think: {"thought": "\\ud800"}',  # a lone surrogate: still a string
    ],
)
def test_parse_tool_call_never_raises(content):
    parsed = parse_tool_call(content)
    assert parsed is None or parsed == ("think", {"thought": "\ud800"})


def test_a_stored_value_too_deep_to_hash_scores_zero_instead_of_raising(cfg):
    """tau-bench stores arguments as given; a 600-deep list makes the final hash recurse too far (tau-bench's own
    hash would raise too). The episode ends with reward 0: such a database can never be the gold one."""
    nested = json.loads("[" * 600 + "]" * 600)
    address = {"address2": "", "city": "c", "state": "s", "country": "x", "zip": "1"}
    results = play(
        _gym("tau_retail", "retail-000", cfg),
        [
            _answer("modify_user_address", user_id="yusuf_rossi_9620", address1=nested, **address),
            _answer("transfer_to_human_agents", summary="bye"),
        ],
    )
    assert (results[-1].feedback, results[-1].reward, results[-1].done) == ("Transfer successful", 0.0, True)
    assert results[-1].info["reward_info"] == {
        "r_actions": 0.0,
        "error": "the database holds a value nested too deeply to hash",
    }
