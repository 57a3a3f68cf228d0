"""Structured generation in the embedded engine (`server/grammar.py`): which sampling params ask for a grammar, the
JSON Schema features refused as SGLang refuses them, the compile cache (invalid grammars included), the bitmask on
the sampler's rows (a grammar row never touches a free one), the grammar's end as the request's end, the launch
flags of JSON whitespace, and an in-process engine answering json_schema, regex and ebnf requests."""

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar
from transformers import AutoTokenizer

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config import load_config
from userrl_megatron.config.schema import EmbeddedServerConfig, SGLangConfig
from userrl_megatron.fleet.launch import embedded_server_command
from userrl_megatron.fleet.sglang import sglang_command
from userrl_megatron.fleet.simulator import simulator_rollout
from userrl_megatron.model_store import resolve_model
from userrl_megatron.server.grammar import (
    GrammarError,
    Grammars,
    _apply_unpacked,
    apply_bitmasks,
    check_json_schema,
    grammar_key,
)
from userrl_megatron.server.sampling import SampleRow, parse_sampling_params, sample

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["answer", "score"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], any_whitespace=False)  # compact JSON


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({}, None),
        ({"regex": "", "json_schema": None}, None),
        ({"regex": "a+"}, ("regex", "a+")),
        ({"json_schema": "{}"}, ("json_schema", "{}")),
        ({"ebnf": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
    ],
)
def test_the_sampling_params_name_one_grammar(raw: dict[str, Any], expected: Any) -> None:
    assert grammar_key(raw) == expected


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"regex": "a", "json_schema": "{}"}, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
        ({"ebnf": "x", "structural_tag": "{}"}, "Only one of json_schema, regex, ebnf, or structural_tag can be set."),
        ({"structural_tag": "{}"}, "sampling_params.structural_tag is not supported by the embedded server."),
        ({"json_schema": {"type": "object"}}, "json_schema must be a string, got dict."),
    ],
)
def test_refused_grammar_params(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_sampling_params(raw, 100)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "schema, pointer, reason",
    [
        ({"type": "integer", "multipleOf": 3}, "#", "keyword(s) multipleOf would be ignored"),
        ({"properties": {"a/b": {"not": {}}}}, "#/properties/a~1b", "keyword(s) not would"),
        ({"items": {"type": "string", "format": "colour"}}, "#/items", "string format 'colour' is not"),
        ({"anyOf": [{"pattern": "a", "maxLength": 2}]}, "#/anyOf/0", "constraints pattern, minLength"),
    ],
)
def test_schema_features_xgrammar_would_ignore_are_refused(schema: dict[str, Any], pointer: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"JSON Schema at {pointer} is not supported by xgrammar: {reason}")):
        check_json_schema(schema)


def test_enforceable_schemas_pass() -> None:
    check_json_schema(SCHEMA)
    check_json_schema({"type": "integer", "format": "anything"})  # a format on a non-string is not a string format
    check_json_schema(True)


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(grammars: Grammars) -> None:
    before = grammars.compiled
    spec = json.dumps(SCHEMA)
    first, second = grammars.matcher("json_schema", spec), grammars.matcher("json_schema", spec)
    assert grammars.compiled == before + 1 and first is not second
    assert first.accept_string('{"answer": "yes"') and not second.is_terminated()
    assert second.accept_string('{"answer": "no"')  # the first one's state is not the second's


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("json_schema", '{"type": "object",', "Failed to compile json grammar: Expecting property name enclosed"),
        ("json_schema", "[1]", "Failed to compile json grammar: Schema should be an object or bool, but got [1]"),
        ("json_schema", '{"type": "colour"}', 'Failed to compile json grammar: Unsupported type "colour"'),
        ("regex", "(ab", "Failed to compile regex grammar: Regex parsing error at position 4: The parenthesis is not"),
        ("ebnf", "root ::= foo", 'Failed to compile ebnf grammar: EBNF parser error at line 1, column 10: Rule "foo"'),
    ],
)
def test_invalid_grammars_name_the_problem_and_are_cached(
    grammars: Grammars, kind: str, spec: str, message: str
) -> None:
    for attempt in range(2):
        with pytest.raises(GrammarError) as e:
            grammars.compile(kind, spec)
        assert str(e.value).startswith(message), str(e.value)
        if attempt == 0:
            compiled = grammars.compiled
    assert grammars.compiled == compiled


def test_the_cache_keeps_the_most_recent(tokenizer: Any) -> None:
    small = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_cached=2)
    for spec in ("a", "b", "a", "c", "a"):
        small.compile("regex", spec)
    assert small.compiled == 3  # "a" stayed (used last), "b" went when "c" came


def test_the_mask_touches_grammar_rows_only_and_matches_the_torch_path(tokenizer: Any, grammars: Grammars) -> None:
    torch.manual_seed(0)
    vocab = len(tokenizer)
    logits = torch.randn(4, vocab)
    matchers = [grammars.matcher("regex", "[0-9]+"), None, grammars.matcher("regex", "(yes|no)"), None]
    masked = logits.clone()
    apply_bitmasks(masked, matchers)
    assert torch.equal(masked[1], logits[1]) and torch.equal(masked[3], logits[3])
    allowed = [set(torch.isfinite(masked[i]).nonzero().flatten().tolist()) for i in (0, 2)]
    assert allowed[0] and all(tokenizer.decode([t]).isdigit() for t in allowed[0])
    assert allowed[1] and all(
        "yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t])) for t in allowed[1]
    )
    bitmask = xgrammar.allocate_token_bitmask(4, vocab)
    for i in (0, 2):
        matchers[i].fill_next_token_bitmask(bitmask, i)
    unpacked = logits.clone()
    _apply_unpacked(unpacked, bitmask)  # the path of a logits tensor on a GPU
    assert torch.equal(unpacked, masked)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_mixed_batch_samples_each_grammar_to_its_end(tokenizer: Any, grammars: Grammars, temperature: float) -> None:
    """Random logits stand for a model: every grammar row ends with EOS on text its grammar matches, EOS only
    where the grammar may end; free rows draw from their untouched logits."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    specs = [
        ("regex", r"(yes|no), [0-9]{1,3}"),
        None,
        ("json_schema", json.dumps(SCHEMA)),
        None,
        ("ebnf", 'root ::= "A" "B"*'),
    ]
    rows = []
    for spec in specs:
        params = {"temperature": temperature, "max_new_tokens": 64}
        if spec:
            params[spec[0]] = spec[1]
        rows.append(
            SampleRow(parse_sampling_params(params, vocab), [], None, (), grammars.matcher(*spec) if spec else None)
        )
    torch.manual_seed(1)
    done = [spec is None for spec in specs]
    for _ in range(64):
        logits = torch.randn(len(rows), vocab) * 3
        logits[:, eos] -= 4.0  # a model that does not rush to its end: the grammar has to hold EOS back
        free = logits.clone()
        out = sample(logits, rows, 0)
        assert not out.failed
        for i, row in enumerate(rows):
            if specs[i] is None:
                assert torch.equal(logits[i], free[i])
                continue
            if done[i]:
                continue
            assert row.grammar.accept_token(out.tokens[i])
            row.output_ids.append(out.tokens[i])
            if row.grammar.is_terminated():  # the request ends: its row samples freely from now on, unchecked
                done[i], rows[i] = True, SampleRow(row.spec, row.output_ids, None)
        if all(done):
            break
    assert all(done)
    texts = {spec[0]: tokenizer.decode(rows[i].output_ids[:-1]) for i, spec in enumerate(specs) if spec}
    assert all(rows[i].output_ids[-1] == eos for i, spec in enumerate(specs) if spec)
    assert re.fullmatch(r"(yes|no), [0-9]{1,3}", texts["regex"])
    value = json.loads(texts["json_schema"])
    assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no") and isinstance(value["score"], int)
    assert re.fullmatch("AB*", texts["ebnf"])


def test_whitespace_flags_reach_both_backends_and_the_simulator_holds_json_tight() -> None:
    tight = EmbeddedServerConfig(constrained_json_disable_any_whitespace=True, constrained_json_max_whitespace_cnt=2)
    command = embedded_server_command("/m", tight, 31000, python="py")
    assert "--constrained-json-disable-any-whitespace" in command
    assert command[command.index("--constrained-json-max-whitespace-cnt") + 1] == "2"
    assert "--constrained-json-disable-any-whitespace" not in embedded_server_command("/m", EmbeddedServerConfig(), 1)
    sglang = sglang_command(SGLangConfig(constrained_json_disable_any_whitespace=True), "/m", 1, 1, python="py")
    assert "--constrained-json-disable-any-whitespace" in sglang
    cfg = load_config(overrides=["user_sim.engines.model=m"])
    rollout = simulator_rollout(cfg)
    assert rollout.embedded.constrained_json_disable_any_whitespace
    assert rollout.sglang.constrained_json_disable_any_whitespace
    assert not cfg.rollout.embedded.constrained_json_disable_any_whitespace  # the policy's engines keep the default


def test_an_engine_serves_grammars_and_ends_them_as_sglang(tmp_path: Path) -> None:
    """A tiny random Qwen3 (the real Qwen3 tokenizer): greedy regex and schema requests end with EOS on matching
    text (finish "stop"); a grammar that cannot finish in max_new_tokens ends "length"; compact JSON."""
    from userrl_megatron.server.core import EngineCore
    from userrl_megatron.server.http import make_request
    from userrl_megatron.server.protocol import parse_generate

    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", tokenizer="qwen3")
    core = EngineCore(str(model_dir), EmbeddedServerConfig(device="cpu", constrained_json_disable_any_whitespace=True))
    core.start()
    tokenizer = core.model.tokenizer
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    async def run(params: dict[str, Any]) -> Any:
        items, _ = parse_generate({"input_ids": [5, 6, 7], "sampling_params": params}, core.model)
        requests = [make_request(core, item) for item in items]
        await core.attach_grammars(requests)
        return await core.generate(requests[0])

    try:
        regex = asyncio.run(run({"regex": "(yes|no)!", "max_new_tokens": 16, "temperature": 0}))
        schema = asyncio.run(run({"json_schema": json.dumps(small), "max_new_tokens": 32, "temperature": 0}))
        short = asyncio.run(run({"json_schema": json.dumps(small), "max_new_tokens": 2, "temperature": 0}))
        with pytest.raises(GrammarError, match="Failed to compile regex grammar"):
            asyncio.run(run({"regex": "("}))
    finally:
        core.shutdown()
    assert regex.finish_reason == {"type": "stop", "matched": regex.output_ids[-1]}
    assert regex.output_ids[-1] in core.model.spec.eos_token_ids
    assert re.fullmatch(r"(yes|no)!", tokenizer.decode(regex.output_ids[:-1]))
    assert schema.finish_reason["type"] == "stop"
    text = tokenizer.decode(schema.output_ids[:-1])
    assert json.loads(text) in ({"ok": True}, {"ok": False}) and "\n" not in text and "  " not in text
    assert short.finish_reason == {"type": "length", "length": 2} and len(short.output_ids) == 2
