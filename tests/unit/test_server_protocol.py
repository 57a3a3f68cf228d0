"""SGLang request parsing: sampling-params validation, the 0.5.23 contract check, batch and n expansion."""

from types import SimpleNamespace

import pytest
import torch

from userrl_megatron.server.protocol import (
    SAMPLING_FIELDS,
    check_logprob_fields,
    contract_error,
    parse_generate,
    should_stream,
    stream_interval,
)
from userrl_megatron.server.sampling import SampleRow, parse_sampling_params, sample
from userrl_megatron.types import SamplingParams

VOCAB = 50


def test_defaults_and_greedy_encoding() -> None:
    spec = parse_sampling_params({}, VOCAB)
    assert (spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k, spec.greedy) == (128, 1.0, 1.0, -1, False)
    greedy = parse_sampling_params({"temperature": 0.0, "max_new_tokens": None}, VOCAB)
    assert (greedy.temperature, greedy.top_k, greedy.greedy, greedy.max_new_tokens) == (1.0, 1, True, 128)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": float("nan")}, "temperature must be a non-negative finite number, got nan."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3.0."),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0."),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        ({"max_new_tokens": 2, "min_new_tokens": 3}, "min_new_tokens must be in [0, max_new_tokens(2)], got 3."),
        ({"logit_bias": {"50": 1.0}}, "logit_bias must has keys in [0, 49], got 50."),
        ({"sampling_seed": 2**63}, "sampling_seed must be in [-2**63, 2**63 - 1], got 9223372036854775808."),
        ({"stop_regex": "a+"}, "sampling_params.stop_regex is not supported by the embedded server."),
        (
            {"regex": "a+", "ebnf": 'root ::= "a"'},
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
        ),
    ],
)
def test_invalid_sampling_params_use_sglangs_messages(params: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_sampling_params(params, VOCAB)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "params, message",
    [
        ({"stop_token_ids": [50]}, "stop_token_ids must be in [0, 49], got [50]."),
        ({"stop_token_ids": [2**70], "min_new_tokens": 2}, f"stop_token_ids must be in [0, 49], got [{2**70}]."),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be in [0, 49], got [-1]."),
        ({"logit_bias": {"5": 1e308}}, "logit_bias values must be in [-100, 100], got 1e+308 for token 5."),
        ({"logit_bias": {"5": float("nan")}}, "logit_bias values must be in [-100, 100], got nan for token 5."),
        ({"logit_bias": {"5": "x"}}, "logit_bias values must be numbers, got 'x' for token 5."),
        ({"logit_bias": {"a": 1.0}}, "logit_bias keys must be token ids, got 'a'."),
        ({"logit_bias": [1]}, "logit_bias must be a map of token ids to numbers, got [1]."),
        ({"temperature": 10**400}, f"temperature must be a finite number, got {10**400}."),
        ({"top_p": {}}, "top_p must be a number, got {}."),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer, got 1.5."),
        ({"stop": ["a"] * 33}, "at most 32 stop strings are allowed, got 33"),
        ({"stop": [1]}, "stop must be a string or a list of strings, got [1]."),
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"n": 129}, "n must be at most 128, got 129."),
    ],
)  # fmt: skip
def test_values_the_model_cannot_take_are_refused_naming_the_field(params: dict, message: str) -> None:
    """Each of these got past validation at 84e0012 and failed the whole batch inside the scheduler."""
    with pytest.raises(ValueError) as e:
        parse_sampling_params(params, VOCAB)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 1_000_000},
            "top_logprobs_num must be in [0, 50], got 1000000.",
        ),
        (
            {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": -5},
            "top_logprobs_num must be in [0, 50], got -5.",
        ),
        ({"input_ids": [1, 2], "top_logprobs_num": -5}, "top_logprobs_num must be in [0, 50], got -5."),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
            "req.logprob_start_len=3 is higher than the number of input tokens len(req.origin_input_ids)=2. "
            "Please use a smaller logprob_start_len.",
        ),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -2},
            "logprob_start_len must be -1 (none) or at least 0, got -2.",
        ),
    ],
)  # fmt: skip
def test_logprob_fields_are_checked_against_the_model(body: dict, message: str) -> None:
    items, _ = parse_generate(body, _model())
    with pytest.raises(ValueError) as e:
        check_logprob_fields(items[0], VOCAB)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "n must be at least 1, got 0."),
        ({"input_ids": [1], "sampling_params": {"n": 2**70}}, f"n must be at most 128, got {2**70}."),
        ({"text": "abc", "sampling_params": {"n": 0}}, "n must be at least 1, got 0."),
        (
            {"text": ["ab", "abcdef"]},
            "The text prompt has 6 characters, more than this server takes (5: rollout.embedded.max_prompt_chars).",
        ),
    ],
)  # fmt: skip
def test_n_and_prompt_length_are_checked_before_expanding_or_tokenising(body: dict, message: str) -> None:
    def refuse(text: str) -> list[int]:
        raise AssertionError(f"tokenised {text!r}")

    with pytest.raises(ValueError) as e:
        parse_generate(body, SimpleNamespace(encode=refuse), max_prompt_chars=5)
    assert str(e.value) == message


def test_project_sampling_params_pass_the_contract() -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[3], seed=5)
    body = {"input_ids": [1, 2], "sampling_params": params.to_dict(), "return_logprob": True}
    assert contract_error(body) is None
    assert set(params.to_dict()) <= set(SAMPLING_FIELDS)


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "invalid type: sequence, expected struct GenerateRequest"),
        ({"input_ids": "abc"}, 'invalid type: string "abc", expected a value or an array of values for TokenIdsOrList'),
        ({"input_ids": [1, 2.5]}, "invalid type: floating point `2.5`, expected i64"),
        ({"input_ids": [1], "stream": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"input_ids": [1], "sampling_params": {"top_p": "x"}}, 'invalid type: string "x", expected f64'),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": 0}}, "invalid type: integer `0`, expected a boolean"),
        ({"input_ids": [1], "sampling_params": {"stream_interval": "4"}}, 'invalid type: string "4", expected i64'),
        (
            {"input_ids": [1], "return_logprob": "yes"},
            'invalid type: string "yes", expected a value or an array of values for BoolOrList',
        ),
    ],
)  # fmt: skip
def test_contract_errors(body: object, message: str) -> None:
    assert contract_error(body) == message


def streamed(max_new_tokens: int, interval: int) -> list[int]:
    """How many tokens each chunk of a streamed request carries (the last one: the finished request)."""
    chunks, sent = [], 0
    for produced in range(1, max_new_tokens):  # a running request after each token
        if should_stream(sent, produced, interval):
            chunks.append(produced)
            sent = produced
    return [*chunks, max_new_tokens]


def test_stream_interval_sends_the_first_token_then_every_interval_as_sglang() -> None:
    assert [stream_interval({}), stream_interval({"stream_interval": None})] == [1, 1]
    assert stream_interval({"stream_interval": 0}) == 1
    assert stream_interval({"stream_interval": 4}) == 4
    assert streamed(6, 1) == [1, 2, 3, 4, 5, 6]
    assert streamed(10, 4) == [1, 5, 9, 10]
    assert streamed(48, 48) == [1, 48]  # the benchmark's setting: time to first token, then the whole turn
    assert streamed(5, -3) == [1, 2, 3, 4, 5]  # SGLang sends every token when unsent >= a negative interval


def _model() -> SimpleNamespace:
    return SimpleNamespace(encode=lambda text: [ord(c) for c in text])


def test_batch_n_and_rid_expansion() -> None:
    items, single = parse_generate({"input_ids": [1, 2], "rid": "r"}, _model())
    assert single and [(i.rid, i.input_ids) for i in items] == [("r", [1, 2])]
    items, single = parse_generate({"text": ["ab", "c"], "rid": "r", "return_logprob": [True, False]}, _model())
    assert not single and [(i.rid, i.input_ids, i.return_logprob) for i in items] == [
        ("r_0", [97, 98], True),
        ("r_1", [99], False),
    ]
    items, single = parse_generate({"input_ids": [[1], [2]], "sampling_params": {"n": 2, "temperature": 0.5}}, _model())
    assert not single and [i.input_ids for i in items] == [[1], [1], [2], [2]]
    assert len({i.rid for i in items}) == 4 and all(i.sampling == {"temperature": 0.5} for i in items)
    with pytest.raises(ValueError, match=r"^The n parameter must be the same for all requests in a batch\.$"):
        parse_generate({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, _model())
    with pytest.raises(ValueError, match=r"^The length of return_logprob \(3\) does not match the batch size \(2\)\.$"):
        parse_generate({"input_ids": [[1], [2]], "return_logprob": [True, True, True]}, _model())


def test_sampler_logprobs_and_truncation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.0]])
    greedy = parse_sampling_params({"temperature": 0}, 4)
    hot = parse_sampling_params({"temperature": 2.0, "top_k": 1}, 4)  # top_k 1 draws the argmax but keeps T
    rows = [SampleRow(greedy, [], None), SampleRow(hot, [], torch.Generator().manual_seed(0))]
    out = sample(logits.clone(), rows, top_logprobs=2)
    tokens, logprobs, top = out.tokens, out.logprobs, out.top
    assert tokens == [0, 1] and out.failed == {}
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())
    assert logprobs[1] == pytest.approx(torch.log_softmax(logits[1] / 2.0, -1)[1].item())  # before truncation
    assert top.indices.tolist() == [[0, 1], [1, 2]]
    nucleus = parse_sampling_params({"top_p": 0.5}, 4)  # token 1 alone holds > 50% of row 2's mass
    draws = {
        sample(logits[1:].clone(), [SampleRow(nucleus, [], torch.Generator().manual_seed(s))]).tokens[0]
        for s in range(20)
    }
    assert draws == {1}
    banned = sample(logits[:1].clone(), [SampleRow(greedy, [], None, banned=(0,))]).tokens
    assert banned == [1]
