"""Each gym's simulator-call schemas (gyms/*/replies.py) against the gym's own parser: what a structured reply may
hold the gym accepts, and the values the gym refuses (unknown stances, grades, verdicts, missing keys) the schema
refuses too. The gyms run for real; only the simulator is a stand-in that answers each call's schema."""

import asyncio
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

import gyms
from gyms.base import StepResult, gym_spec, make_gym
from gyms.reply_json import extract_json_object
from gyms.reply_schema import ReplySchema, objects, one_of, text
from gyms.user_sim import Reply

Example = dict[str, Any]


def variants(schema: dict[str, Any]) -> list[Any]:
    """Values `schema` admits: every enum value, and one of each other kind (objects: the first value of each
    property, then each property's every value in turn)."""
    if "enum" in schema:
        return list(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return ["some text"]
    if kind == "boolean":
        return [True, False]
    if kind == "integer":
        return [1]
    if kind == "array":
        count = schema.get("minItems", 1)
        return [[value] * count for value in variants(schema["items"])]
    base = {key: variants(sub)[0] for key, sub in schema["properties"].items()}
    out = [base]
    for key, sub in schema["properties"].items():
        out += [{**base, key: value} for value in variants(sub)[1:]]
    return out


class Stand:
    """The simulator: answers the call named `target` with `reply`, every other call with its schema's first
    variant; records each call's schema and system prompt."""

    def __init__(self, target: str = "", reply: Example | None = None) -> None:
        self.target, self.reply = target, reply
        self.schemas: dict[str, ReplySchema] = {}
        self.prompts: dict[str, str] = {}

    async def chat(
        self, messages: list[dict[str, Any]], *, temperature: Any = None, max_tokens: Any = None, json: bool = False,
        schema: ReplySchema | None = None,
    ) -> Reply:  # fmt: skip
        assert json and schema is not None, "every JSON call of a built-in gym states its reply schema"
        self.schemas[schema.name] = schema
        self.prompts[schema.name] = messages[0]["content"]
        answer = self.reply if schema.name == self.target and self.reply is not None else variants(schema.schema())[0]
        text_ = _dumps(answer)
        return Reply(text=text_, data=extract_json_object(text_))


def _dumps(obj: Any) -> str:
    return json.dumps(obj)


def task(name: str) -> Any:
    return gym_spec(name).smoke()[0].task


# (gym, action, the call it makes) for every simulator call of every gym.
CALLS = [
    ("telepathy", "[action] Is it alive?", "telepathy_question"),
    ("telepathy", "[answer] a cat", "telepathy_guess"),
    ("turtle", "[action] Was she murdered?", "turtle_question"),
    ("turtle", "[answer] She was hanged.", "turtle_story"),
    ("persuade", "[action] Consider the costs.", "persuade_persona"),
    ("search", "[answer] surely not the answer", "search_judge"),
    ("intention", "[action] Which city?", "intention_user"),
    ("intention", "[action] Which city?", "intention_judge"),
    ("travel", "[search] flights from Paris", "travel_search_judge"),
    ("travel", "[action] Which airline do you prefer?", "travel_utterance_judge"),
    ("travel", "[action] Hello there!", "travel_traveller"),
]


def step(name: str, action: str, sim: Stand) -> StepResult:
    async def run() -> StepResult:
        gym = make_gym(name, task(name), user_sim=sim)
        await gym.reset()
        try:
            return await gym.step(action)
        finally:
            await gym.close()

    return asyncio.run(run())


def schema_of(name: str, action: str, call: str) -> ReplySchema:
    sim = Stand()
    step(name, action, sim)
    assert call in sim.schemas, f"{name}: {action!r} made calls {sorted(sim.schemas)}, not {call}"
    return sim.schemas[call]


def accepted(name: str, action: str, call: str, reply: Example) -> bool:
    """Whether the gym's parser takes `reply` to the call (no simulator error)."""
    return step(name, action, Stand(call, reply)).user_sim_error is None


def valid(schema: ReplySchema, reply: Example) -> bool:
    return jsonschema.Draft202012Validator(schema.schema()).is_valid(reply)


def test_every_simulator_gym_states_its_calls() -> None:
    """Every registered gym that needs the simulator has its calls listed here (a new one must add them)."""
    needing = {n for n in gyms.list_gyms() if gym_spec(n).needs_user_sim and not n.startswith("tau")}
    assert needing == {name for name, _, _ in CALLS}  # tau's customer is free text (gyms/tau/user.py): no schema


@pytest.mark.parametrize(("name", "action", "call"), CALLS, ids=[c for _, _, c in CALLS])
def test_what_the_schema_admits_the_gym_accepts(name: str, action: str, call: str) -> None:
    schema = schema_of(name, action, call)
    examples = variants(schema.schema())
    assert len(examples) >= 2 or not any("enum" in p for p in schema.properties.values())
    for reply in examples:
        assert valid(schema, reply), reply
        assert accepted(name, action, call, reply), reply


@pytest.mark.parametrize(("name", "action", "call"), CALLS, ids=[c for _, _, c in CALLS])
def test_a_reply_without_a_needed_key_is_refused_by_both(name: str, action: str, call: str) -> None:
    schema = schema_of(name, action, call)
    base = variants(schema.schema())[0]
    assert schema.needs
    for key in schema.needs:
        reply = {k: v for k, v in base.items() if k != key}
        assert not valid(schema, reply) and not accepted(name, action, call, reply), key


@pytest.mark.parametrize(("name", "action", "call"), CALLS, ids=[c for _, _, c in CALLS])
def test_the_prompt_names_every_key(name: str, action: str, call: str) -> None:
    sim = Stand()
    step(name, action, sim)
    for key in sim.schemas[call].properties:
        assert f'"{key}"' in sim.prompts[call], key


def _with_score(value: Any) -> Callable[[Example], Example]:
    return lambda base: {**base, "scores": [{**base["scores"][0], "score": value}, *base["scores"][1:]]}


# Values outside what the gym checks, refused by the schema and by the parser alike.
REFUSED: list[tuple[str, str, str, Callable[[Example], Example]]] = [
    ("persuade", "[action] Consider the costs.", "persuade_persona", lambda b: {**b, "stance": "Somewhat Agree"}),
    ("persuade", "[action] Consider the costs.", "persuade_persona", lambda b: {**b, "stance": "strongly agree"}),
    ("persuade", "[action] Consider the costs.", "persuade_persona", lambda b: {**b, "stance": 3}),
    ("turtle", "[answer] She was hanged.", "turtle_story", _with_score(0.7)),
    ("turtle", "[answer] She was hanged.", "turtle_story", _with_score("0.5")),
    ("turtle", "[answer] She was hanged.", "turtle_story", _with_score(True)),
    ("turtle", "[answer] She was hanged.", "turtle_story", lambda b: {**b, "scores": b["scores"][1:]}),
    ("turtle", "[answer] She was hanged.", "turtle_story", lambda b: {**b, "scores": b["scores"] * 2}),
    ("turtle", "[answer] She was hanged.", "turtle_story", lambda b: {**b, "scores": 1.0}),
    ("travel", "[search] flights from Paris", "travel_search_judge", lambda b: {**b, "alignment_judgement": "Maybe"}),
    ("travel", "[search] flights from Paris", "travel_search_judge", lambda b: {**b, "alignment_judgement": "true"}),
    ("travel", "[search] flights from Paris", "travel_search_judge", lambda b: {**b, "alignment_judgement": True}),
]


@pytest.mark.parametrize(("name", "action", "call", "change"), REFUSED)
def test_values_outside_the_gyms_checks_are_refused_by_both(
    name: str, action: str, call: str, change: Callable[[Example], Example]
) -> None:
    schema = schema_of(name, action, call)
    reply = change(variants(schema.schema())[0])
    assert not valid(schema, reply), reply
    assert not accepted(name, action, call, reply), reply


def test_judgments_beyond_the_prompts_words_are_read_as_userrl_read_them() -> None:
    """Telepathy's and Search's parsers read any judgment but "Yes" as a wrong answer (UserRL); the schema only
    narrows what the judge writes to the prompt's two words."""
    for name, action, call in (CALLS[1], CALLS[5]):
        schema = schema_of(name, action, call)
        reply = {**variants(schema.schema())[0], "judgment": "Maybe"}
        assert not valid(schema, reply)
        result = step(name, action, Stand(call, reply))
        assert result.user_sim_error is None and result.info["correct"] is False


def test_turtle_story_schema_has_one_entry_per_rubric_statement() -> None:
    schema = schema_of("turtle", "[answer] She was hanged.", "turtle_story")
    statements = len(task("turtle")["evaluation"])
    assert schema.schema()["properties"]["scores"]["minItems"] == statements
    assert schema.schema()["properties"]["scores"]["maxItems"] == statements


def test_intention_judge_names_at_most_the_details_left() -> None:
    numbers = schema_of("intention", "[action] Which city?", "intention_judge").schema()["properties"]
    details = len(task("intention")["missing_details"])
    assert numbers["covered_detail_numbers"]["maxItems"] == details  # not counting on until the token limit
    assert numbers["covered_detail_numbers"]["items"] == {"type": "integer", "minimum": 1, "maximum": details}


def test_a_text_cap_reaches_every_free_text_string() -> None:
    schema = schema_of("turtle", "[answer] She was hanged.", "turtle_story").response_format(80)["json_schema"]
    story = schema["schema"]["properties"]
    entry = story["scores"]["items"]["properties"]
    assert story["feedback"]["maxLength"] == entry["statement"]["maxLength"] == entry["thought"]["maxLength"] == 80
    assert "maxLength" not in entry["score"]
    assert schema_of("turtle", "[answer] She was hanged.", "turtle_story").response_format() == (
        schema_of("turtle", "[answer] She was hanged.", "turtle_story").response_format(0)
    )  # 0: no cap


def test_response_format_is_openais_strict_json_schema() -> None:
    reply = ReplySchema("a_call", {"thought": text(), "grade": one_of((0.0, 1.0))}, needs=("grade",))
    assert reply.response_format() == {
        "type": "json_schema",
        "json_schema": {
            "name": "a_call",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {"thought": {"type": "string"}, "grade": {"type": "number", "enum": [0.0, 1.0]}},
                "required": ["thought", "grade"],
                "additionalProperties": False,
            },
        },
    }
    assert objects({"a": text()}, 2)["items"]["additionalProperties"] is False
    with pytest.raises(ValueError, match="not among its properties"):
        ReplySchema("bad", {"a": text()}, needs=("b",))
