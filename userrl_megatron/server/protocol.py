"""SGLang `/generate` JSON: the 0.5.23 contract check, request normalisation and the response objects.

Messages are SGLang's own (its serde-style contract errors, `GenerateReqInput` checks), so a client that handles
a real server's 400s handles ours.
"""

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from userrl_megatron.server.model import EngineModel
from userrl_megatron.server.sampling import MAX_N
from userrl_megatron.server.scheduler import Request

# SGLang 0.5.23 `sglang.api.v1.SamplingParams` fields, in its order (the contract lists them in errors).
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


class ContractError(ValueError):
    """The body violates SGLang's JSON contract (answered as 400 {"error": "<message>"})."""


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _expect(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v: Any) -> None:
    _expect(isinstance(v, list), v, "a sequence")
    for e in v:
        _expect(_is_int(e), e, "i64")


def _or_list(v: Any, check: Any, name: str) -> None:
    if isinstance(v, list):
        for e in v:
            check(e, "i64" if name == "Int64OrList" else "a boolean" if name == "BoolOrList" else "a string")
    else:
        check(v, f"a value or an array of values for {name}")


def _check_sampling(value: Any) -> None:
    _expect(isinstance(value, dict), value, "struct SamplingParams")
    for key, x in value.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if x is None:
            continue
        if key in _INT_FIELDS:
            _expect(_is_int(x), x, "i64")
        elif key in _FLOAT_FIELDS:
            _expect(isinstance(x, (int, float)) and not isinstance(x, bool), x, "f64")
        elif key in _BOOL_FIELDS:
            _expect(isinstance(x, bool), x, "a boolean")
        elif key in _STR_FIELDS:
            _expect(isinstance(x, str), x, "a string")
        elif key in ("stop", "stop_regex"):
            _or_list(x, lambda e, exp: _expect(isinstance(e, str), e, exp), "StringOrList")
        elif key == "stop_token_ids":
            _int_list(x)
        elif key == "logit_bias":
            _expect(isinstance(x, dict), x, "a map")


def contract_error(body: Any) -> str | None:
    """SGLang 0.5.23's `/generate` contract check for the fields this server reads; None when the body passes."""
    try:
        _expect(isinstance(body, dict), body, "struct GenerateRequest")
        for key, x in body.items():
            if x is None:
                continue
            if key in ("rid", "text"):
                _or_list(x, lambda e, exp: _expect(isinstance(e, str), e, exp), "StringOrList")
            elif key == "input_ids":
                _expect(isinstance(x, list), x, "a value or an array of values for TokenIdsOrList")
                if x and isinstance(x[0], list):
                    for row in x:
                        _int_list(row)
                else:
                    _int_list(x)
            elif key in ("stream", "return_text_in_logprobs"):
                _expect(isinstance(x, bool), x, "a boolean")
            elif key == "sampling_params":
                for params in x if isinstance(x, list) else [x]:
                    _check_sampling(params)
            elif key == "return_logprob":
                _or_list(x, lambda e, exp: _expect(isinstance(e, bool), e, exp), "BoolOrList")
            elif key in ("logprob_start_len", "top_logprobs_num"):
                _or_list(x, lambda e, exp: _expect(_is_int(e), e, exp), "Int64OrList")
            elif key == "routed_experts_start_len":
                _expect(_is_int(x), x, "i64")
            elif key == "return_routed_experts":
                _expect(isinstance(x, bool), x, "a boolean")
    except ContractError as e:
        return str(e)
    return None


@dataclass
class GenerateItem:
    """One sequence to generate, after batch and `n` expansion."""

    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # first position whose routing is returned (0 … prompt length)


def check_logprob_fields(item: GenerateItem, vocab_size: int, max_top: int = 0) -> None:
    """`top_logprobs_num` within the vocabulary and at most `max_top` (0: no bound but the vocabulary), and
    `logprob_start_len` within the prompt; ValueError names the field. SGLang 0.5.23 checks neither up front (an
    out-of-range count fails its scheduler's batch, and a count of the vocabulary's size makes megabytes of JSON
    per token); a start beyond the prompt is its own abort message."""
    bound = min(vocab_size, max_top) if max_top else vocab_size
    if not 0 <= item.top_logprobs_num <= bound:
        setting = " (rollout.embedded.max_top_logprobs_num)" if bound < vocab_size else ""
        raise ValueError(f"top_logprobs_num must be in [0, {bound}]{setting}, got {item.top_logprobs_num}.")
    if item.return_logprob:
        if item.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (none) or at least 0, got {item.logprob_start_len}.")
        if item.logprob_start_len > len(item.input_ids):
            raise ValueError(
                f"req.logprob_start_len={item.logprob_start_len} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={len(item.input_ids)}. Please use a smaller logprob_start_len."
            )


def stream_interval(sampling: dict[str, Any]) -> int:
    """`sampling_params.stream_interval` of a streamed request: null or 0 is the server's default, 1 (SGLang's
    `--stream-interval` default)."""
    return int(sampling.get("stream_interval") or 1)


def should_stream(sent: int, produced: int, interval: int) -> bool:
    """Whether a running streamed request sends a chunk now, by SGLang 0.5.23's rule: every token at interval 1;
    otherwise the first token at once, then whenever at least `interval` tokens are unsent. (The finished request
    is always sent.) `sent` tokens went out in earlier chunks, `produced` exist now."""
    unsent = produced - sent
    return interval == 1 or unsent >= interval or (sent == 0 and unsent > 0)


def check_prompt_chars(texts: list[str], limit: int, what: str = "text") -> None:
    """Each text prompt at most `limit` characters (0: no limit); checked before any tokenising."""
    for t in texts:
        if limit and len(t) > limit:
            raise ValueError(
                f"The {what} prompt has {len(t)} characters, more than this server takes ({limit}: "
                "rollout.embedded.max_prompt_chars)."
            )


def parse_generate(
    body: dict[str, Any], model: EngineModel, max_prompt_chars: int = 0
) -> tuple[list[GenerateItem], bool]:
    """The items of a `/generate` body and whether the reply is a single object (one prompt, n == 1).

    Text prompts are tokenised here (callers run this off the event loop when the body has `text`), after their
    length is checked against `max_prompt_chars`."""
    given = [body.get(k) is not None for k in ("text", "input_ids", "input_embeds")]
    if sum(given) != 1:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if body.get("input_embeds") is not None:
        raise ValueError("input_embeds is not supported by the embedded server.")
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        check_prompt_chars(texts, max_prompt_chars)
        _sample_count(body)  # a bad n is refused before the tokenising it would multiply
        prompts = [model.encode(t) for t in texts]
    else:
        assert ids is not None  # exactly one of text, input_ids and input_embeds is given
        single = not (ids and isinstance(ids[0], list))
        prompts = [ids] if single else ids
    if any(len(p) == 0 for p in prompts):
        raise ValueError("input_ids cannot be empty.")
    batch = len(prompts)

    def per_item(key: str, default: Any) -> list[Any]:
        value = body.get(key)
        if value is None:
            return [default] * batch
        if isinstance(value, list) and not (key == "sampling_params" and isinstance(value, dict)):
            if len(value) != batch:
                raise ValueError(f"The length of {key} ({len(value)}) does not match the batch size ({batch}).")
            return [default if v is None else v for v in value]
        return [value] * batch

    n = _sample_count(body)
    rids = _rids(body.get("rid"), batch, single and n == 1)
    return_routed = bool(body.get("return_routed_experts"))
    routed_start = int(body.get("routed_experts_start_len") or 0)
    if return_routed:
        _check_routed_start(routed_start, prompts)
    items = []
    sampling = per_item("sampling_params", {})
    for prompt, params, lp, start, top, rid in zip(
        prompts,
        sampling,
        per_item("return_logprob", False),
        per_item("logprob_start_len", -1),
        per_item("top_logprobs_num", 0),
        rids,
        strict=True,
    ):
        params = {k: v for k, v in params.items() if k != "n"}
        for _ in range(n):
            items.append(
                GenerateItem(
                    rid=rid if n == 1 else uuid.uuid4().hex,
                    input_ids=list(prompt),
                    sampling=params,
                    return_logprob=bool(lp),
                    logprob_start_len=int(start) if lp else -1,
                    top_logprobs_num=int(top),
                    return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
                    return_routed_experts=return_routed,
                    routed_experts_start_len=routed_start,
                )
            )
    return items, single and n == 1


def _sample_count(body: dict[str, Any]) -> int:
    """`sampling_params.n` (one value for the whole batch), in [1, MAX_N]."""
    params = body.get("sampling_params")
    sampling = params if isinstance(params, list) else [params or {}]
    ns = {1 if (s or {}).get("n") is None else s["n"] for s in sampling}
    if len(ns) > 1:
        raise ValueError("The n parameter must be the same for all requests in a batch.")
    n = ns.pop()
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {n}.")
    return n


def _check_routed_start(start: int, prompts: list[list[int]]) -> None:
    """SGLang's checks of `routed_experts_start_len` (it must lie within every prompt)."""
    if start < 0:
        raise ValueError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    shortest = min(len(p) for p in prompts)
    if start > shortest:
        raise ValueError(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={shortest}. Please use a smaller routed_experts_start_len."
        )


def _rids(rid: Any, batch: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(batch)]
    if len(rid) != batch:
        raise ValueError(f"The rid length ({len(rid)}) does not match the batch size ({batch}).")
    duplicates = sorted({r for r in rid if rid.count(r) > 1})
    if duplicates:
        raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(rid)


def output_text(request: Request, model: EngineModel) -> str:
    """Decoded completion; a matched stop string is cut off unless no_stop_trim."""
    text = model.decode(request.output_ids, request.sampling.skip_special_tokens)
    stop = request.matched_stop_text
    if stop is not None and not request.sampling.no_stop_trim and stop in text:
        text = text[: text.index(stop)]
    return text


def generate_response(request: Request, item: GenerateItem, model: EngineModel, final: bool = True) -> dict[str, Any]:
    """The `/generate` object for one sequence (also each streamed chunk, cumulative)."""
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": request.finish_reason if final else None,
        "prompt_tokens": len(request.input_ids),
        "weight_version": request.weight_version,
        "num_retractions": request.num_retractions,
    }
    if item.return_logprob:
        word = _token_text(model) if item.return_text_in_logprobs else (lambda _: None)
        meta["input_token_logprobs"] = [
            [lp, tok, word(tok)]
            for lp, tok in zip(
                request.input_logprobs,
                request.input_ids[len(request.input_ids) - len(request.input_logprobs) :],
                strict=True,
            )
        ]
        meta["output_token_logprobs"] = [
            [lp, tok, word(tok)] for lp, tok in zip(request.output_logprobs, request.output_ids, strict=True)
        ]
        if item.top_logprobs_num:
            meta["input_top_logprobs"] = [
                None if top is None else [[lp, tok, word(tok)] for lp, tok in top] for top in request.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [
                [[lp, tok, word(tok)] for lp, tok in top] for top in request.output_top_logprobs
            ]
        meta["output_token_logprobs_length"] = len(request.output_logprobs)
    meta.update(reasoning_tokens=0, completion_tokens=len(request.output_ids), cached_tokens=request.cached_tokens)
    # SGLang 0.5.23's extra fields: the weight-version spans of the output (one engine label here, set when the
    # request finishes), no cache-tier details, no data-parallel rank.
    meta["weight_versions"] = [{"version": request.weight_version, "start": 0, "end": len(request.output_ids)}]
    meta.update(cached_tokens_details=None, dp_rank=None)
    if final and item.return_routed_experts and request.routed:
        # SGLang's format: base64 of int32 [positions start … prompt + output - 2, layers, top_k], C order.
        ids = request.routed[0].to(torch.int32).contiguous().numpy()
        meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode("ascii")
    if final:
        meta["e2e_latency"] = request.finished_at - request.created
        meta["response_sent_to_client_ts"] = time.time()
    out: dict[str, Any] = {}
    if model.tokenizer is not None:
        out["text"] = output_text(request, model)
    out["output_ids"] = list(request.output_ids)
    out["meta_info"] = meta
    return out


def _token_text(model: EngineModel) -> Any:
    return lambda tok: model.decode([tok], skip_special_tokens=False) if model.tokenizer is not None else None
