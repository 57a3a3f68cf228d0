"""SGLang `sampling_params`: validation with SGLang's messages, and batched sampling with its log-prob semantics.

Log-probs are those of `softmax(logits / temperature)` before top-k/top-p/min-p truncation; greedy requests
(temperature 0, which SGLang turns into temperature 1 with top_k 1) get the raw `log_softmax(logits)`.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch

_SAMPLING_EPS = 1e-6
MAX_STOP_COUNT = 32  # SGLang 0.5.23's limit on stop strings
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value; a larger one overflows float32 logits to inf/nan
MAX_N = 128  # OpenAI's largest n; each sample is a request of its own
# Keys SGLang accepts that this engine cannot honour: refused with a clear message instead of being ignored.
UNSUPPORTED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "custom_params", "watermark")


@dataclass
class SamplingSpec:
    """Validated sampling parameters of one request."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # effective temperature: 1.0 for greedy requests
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)


def parse_sampling_params(raw: dict[str, Any] | None, vocab_size: int) -> SamplingSpec:
    """Build and check a SamplingSpec from a `sampling_params` dict; ValueError carries SGLang's message."""
    raw = dict(raw or {})
    for key in UNSUPPORTED_KEYS:
        if raw.get(key) not in (None, "", {}):
            raise ValueError(f"sampling_params.{key} is not supported by the embedded server.")
    if (raw.get("beam_width") or 1) > 1:
        raise ValueError("sampling_params.beam_width is not supported by the embedded server.")

    def get(key: str, default: Any) -> Any:
        value = raw.get(key)
        return default if value is None else value

    stop = get("stop", [])
    spec = SamplingSpec(
        max_new_tokens=_int(raw, "max_new_tokens", 128),
        min_new_tokens=_int(raw, "min_new_tokens", 0),
        temperature=_float(raw, "temperature", 1.0),
        top_p=_float(raw, "top_p", 1.0),
        top_k=_int(raw, "top_k", -1),
        min_p=_float(raw, "min_p", 0.0),
        frequency_penalty=_float(raw, "frequency_penalty", 0.0),
        presence_penalty=_float(raw, "presence_penalty", 0.0),
        repetition_penalty=_float(raw, "repetition_penalty", 1.0),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=frozenset(_token_ids(get("stop_token_ids", []), vocab_size)),
        ignore_eos=bool(get("ignore_eos", False)),
        skip_special_tokens=bool(get("skip_special_tokens", True)),
        spaces_between_special_tokens=bool(get("spaces_between_special_tokens", True)),
        no_stop_trim=bool(get("no_stop_trim", False)),
        n=_int(raw, "n", 1),
        logit_bias=_logit_bias(get("logit_bias", {})),
        sampling_seed=raw.get("sampling_seed"),
    )
    _verify(spec, vocab_size)
    if 0 <= spec.temperature < _SAMPLING_EPS:  # greedy, as SGLang encodes it
        spec.temperature, spec.top_k = 1.0, 1
    return spec


def _number(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}.")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    """A float field; a number too large for a float is refused naming the field (not an OverflowError)."""
    if raw.get(key) is None:
        return default
    try:
        return float(_number(raw, key))
    except OverflowError:
        raise ValueError(f"{key} must be a finite number, got {raw[key]}.") from None


def _int(raw: dict[str, Any], key: str, default: int) -> int:
    if raw.get(key) is None:
        return default
    value = _number(raw, key)
    if not isinstance(value, int):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{key} must be an integer, got {value}.")
        value = int(value)
    return value


def _token_ids(ids: Any, vocab_size: int) -> list[int]:
    """`stop_token_ids`: token ids of the model's vocabulary (an id outside it cannot be masked or matched)."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {bad[:5]}.")
    return list(ids)


def _logit_bias(bias: Any) -> dict[int, float]:
    """`logit_bias`: token-id keys (checked against the vocabulary in `_verify`), finite values in [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token ids to numbers, got {bias!r}.")
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias values must be numbers, got {value!r} for token {key}.")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
            raise ValueError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value} for token {key}."
            )
        out[token_id] = float(value)
    return out


def _verify(s: SamplingSpec, vocab_size: int) -> None:
    if not math.isfinite(s.temperature) or s.temperature < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {s.temperature}.")
    if not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}.")
    if not 0.0 <= s.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {s.min_p}.")
    if s.top_k < 1 and s.top_k != -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {s.top_k}.")
    if not -2.0 <= s.frequency_penalty <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {s.frequency_penalty}.")
    if not -2.0 <= s.presence_penalty <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {s.presence_penalty}.")
    if not 0.0 < s.repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {s.repetition_penalty}.")
    if s.min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {s.min_new_tokens}.")
    if s.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
    if not s.min_new_tokens <= s.max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({s.max_new_tokens})], got {s.min_new_tokens}.")
    for token_id in s.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    if s.sampling_seed is not None:
        if not isinstance(s.sampling_seed, int):
            raise ValueError(f"sampling_seed must be an integer, got {type(s.sampling_seed).__name__}.")
        if not -(2**63) <= s.sampling_seed <= 2**63 - 1:
            raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {s.sampling_seed}.")
    if s.n < 1:
        raise ValueError(f"n must be at least 1, got {s.n}.")
    if s.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {s.n}.")
    if len(s.stop) > MAX_STOP_COUNT:
        raise ValueError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(s.stop)}")
    if not all(isinstance(stop, str) for stop in s.stop):
        raise ValueError(f"stop must be a string or a list of strings, got {s.stop!r}.")


@dataclass
class SampleRow:
    """What the sampler needs from one running request."""

    spec: SamplingSpec
    output_ids: list[int]
    generator: torch.Generator | None
    banned: tuple[int, ...] = ()  # token ids masked out (EOS/stop ids before min_new_tokens)


@dataclass
class Sampled:
    """What `sample` gives back: per row the token and its log-prob, the top log-probs, and the rows that failed."""

    tokens: list[int]
    logprobs: list[float]
    top: Any  # torch.return_types.topk of [rows, k], or None
    failed: dict[int, Exception]  # row -> the error that row alone raised (its token and log-prob are meaningless)


def sample(logits: torch.Tensor, rows: list[SampleRow], top_logprobs: int = 0) -> Sampled:
    """Next token of every row, its log-prob, and (if asked) the top log-probs of each row.

    logits: [rows, vocab] float32 on the engine's device; modified in place by penalties, biases and bans. Every
    tensor made here is made on that device, and each row's generator must live there too (`torch.multinomial`
    on CUDA refuses a CPU generator). A row whose own settings make a step raise fails alone (`Sampled.failed`):
    every other row of the batch is sampled as if it had not been there.
    """
    failed: dict[int, Exception] = {}
    for i, row in enumerate(rows):
        try:
            _adjust_logits(logits[i], row)
        except Exception as e:
            failed[i] = e
            logits[i] = 0.0  # keeps its row of the batched ops finite; the row's result is discarded
    temperatures = torch.tensor([row.spec.temperature for row in rows], dtype=logits.dtype, device=logits.device)
    logprobs = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)
    tokens = logprobs.argmax(dim=-1)
    for i, row in enumerate(rows):
        if not row.spec.greedy and i not in failed:
            try:
                tokens[i] = _draw(logprobs[i], row.spec, row.generator)
            except Exception as e:
                failed[i] = e
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = min(top_logprobs, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    return Sampled(tokens.tolist(), chosen.tolist(), top, failed)


def _adjust_logits(logits: torch.Tensor, row: SampleRow) -> None:
    spec, device = row.spec, logits.device
    if spec.needs_penalties and row.output_ids:
        ids, counts = torch.tensor(row.output_ids, device=device).unique(return_counts=True)
        picked = logits[ids]
        if spec.repetition_penalty != 1.0:
            picked = torch.where(picked > 0, picked / spec.repetition_penalty, picked * spec.repetition_penalty)
        picked = picked - spec.frequency_penalty * counts.to(logits.dtype) - spec.presence_penalty
        logits[ids] = picked
    if spec.logit_bias:
        ids = torch.tensor(list(spec.logit_bias), device=device)
        logits[ids] += torch.tensor(list(spec.logit_bias.values()), dtype=logits.dtype, device=device)
    if row.banned:
        logits[torch.tensor(row.banned, device=device)] = float("-inf")


def _draw(logprobs: torch.Tensor, spec: SamplingSpec, generator: torch.Generator | None) -> int:
    probs = logprobs.exp()
    if spec.top_k > 0 and spec.top_k < probs.numel():
        kth = probs.topk(spec.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly above each token
        sorted_probs[before > spec.top_p * sorted_probs.sum()] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if spec.min_p > 0.0:
        probs = torch.where(probs >= spec.min_p * probs.max(), probs, 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))
