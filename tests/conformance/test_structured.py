"""Structured generation on both backends (the embedded engine's xgrammar and real SGLang's xgrammar backend on
CPU), SmolLM2-135M-Instruct only (a real model: its constrained text ends where a random one may wander; the
tiny models' grammar paths are covered in tests/unit/test_engine_grammar.py): every output of a json_schema,
regex and ebnf request valid, sampled or greedy; the same 400 for a bad schema, a bad regex and two grammars; a
grammar that cannot finish within max_new_tokens ends "length"; response_format json_schema on
/v1/chat/completions."""

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest

from tests.conformance.conftest import Engine
from tests.conformance.test_generate import chat_ids, post

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
}
REGEX = r"(yes|no), [0-9]{1,2}"


def _smollm2_only(engine: Engine) -> None:
    if engine.model != "smollm2":
        pytest.skip("structured generation is compared on SmolLM2 (a real model) only")


def _generate(engine: Engine, prompt: list[int], *params: dict[str, Any]) -> list[tuple[int, Any]]:
    async def go() -> list[tuple[int, Any]]:
        bodies = [{"input_ids": prompt, "sampling_params": p} for p in params]
        return list(await asyncio.gather(*(post(engine.url, "/generate", b) for b in bodies)))

    return asyncio.run(go())


def test_every_structured_output_is_valid(engine: Engine) -> None:
    _smollm2_only(engine)
    prompt = chat_ids(engine.model_dir, "Describe Paris as JSON: city, population, whether it is a capital.")
    schema = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 48}
    regex = {"regex": REGEX, "max_new_tokens": 12, "temperature": 1.0}
    replies = _generate(
        engine,
        prompt,
        {**schema, "temperature": 0},
        *({**schema, "temperature": 1.0, "top_k": 20, "sampling_seed": seed} for seed in range(2)),
        *({**regex, "sampling_seed": seed} for seed in range(2)),
        {"ebnf": 'root ::= "Paris" | "Lyon"', "max_new_tokens": 8, "temperature": 1.0},
    )
    assert all(status == 200 for status, _ in replies), replies
    texts = [reply["text"] for _, reply in replies]
    reasons = [reply["meta_info"]["finish_reason"] for _, reply in replies]
    assert reasons[0]["type"] == "stop", replies[0]  # greedy JSON ends; sampled JSON may spend its tokens on blanks
    for text, reason in zip(texts[:3], reasons[:3], strict=True):
        if reason["type"] == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
    for text, reason in zip(texts[3:5], reasons[3:5], strict=True):
        assert reason["type"] == "stop" and re.fullmatch(REGEX, text), (text, reason)
    assert texts[5] in ("Paris", "Lyon") and reasons[5]["type"] == "stop"


def test_a_grammar_cut_short_ends_length(engine: Engine) -> None:
    _smollm2_only(engine)
    prompt = chat_ids(engine.model_dir)
    [(status, reply)] = _generate(engine, prompt, {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 3})
    assert status == 200 and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert reply["meta_info"]["completion_tokens"] == 3 and reply["text"].startswith("{")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"json_schema": '{"type": "object",'}, "Failed to compile json grammar: Expecting property name"),
        ({"json_schema": '{"type": "colour"}'}, 'Failed to compile json grammar: Unsupported type "colour"'),
        ({"json_schema": '{"type": "integer", "multipleOf": 2}'}, "keyword(s) multipleOf would be ignored"),
        ({"regex": "(ab"}, "Failed to compile regex grammar: Regex parsing error at position 4"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
    ],
)
def test_bad_grammars_are_the_same_400(engine: Engine, params: dict[str, Any], message: str) -> None:
    _smollm2_only(engine)
    [(status, reply)] = _generate(engine, [1, 2, 3], {**params, "max_new_tokens": 4})
    assert status == 400 and list(reply) == ["error"] and list(reply["error"]) == ["message"], reply
    # SGLang keeps xgrammar's C++ prefix ("[16:39:16] /project/cpp/regex_converter.cc:83: "); the embedded engine not.
    assert message in re.sub(r"\[[\d:]+\] \S+\.cc:\d+: ", "", reply["error"]["message"]), reply


def test_chat_response_format_json_schema(engine: Engine) -> None:
    _smollm2_only(engine)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Describe Paris as JSON: city, population, whether it is a capital."}],
        "max_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    }
    objects = {**body, "response_format": {"type": "json_object"}}

    async def go() -> list[tuple[int, Any]]:
        return list(await asyncio.gather(*(post(engine.url, "/v1/chat/completions", b) for b in (body, objects))))

    (status, reply), (object_status, object_reply) = asyncio.run(go())
    assert status == 200 and reply["choices"][0]["finish_reason"] == "stop", reply
    jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), SCHEMA)
    assert object_status == 200, object_reply
    if object_reply["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(object_reply["choices"][0]["message"]["content"]), dict)
