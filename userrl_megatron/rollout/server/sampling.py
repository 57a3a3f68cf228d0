"""SGLang `sampling_params`: validation with SGLang's messages, and batched sampling with its log-prob semantics.

Log-probs are those of `softmax(logits / temperature)` before top-k/top-p/min-p truncation; greedy requests
(temperature 0, which SGLang turns into temperature 1 with top_k 1) get the raw `log_softmax(logits)`.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch

_SAMPLING_EPS = 1e-6
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

    temperature = float(get("temperature", 1.0))
    top_k = int(get("top_k", -1))
    stop = get("stop", [])
    spec = SamplingSpec(
        max_new_tokens=int(get("max_new_tokens", 128)),
        min_new_tokens=int(get("min_new_tokens", 0)),
        temperature=temperature,
        top_p=float(get("top_p", 1.0)),
        top_k=top_k,
        min_p=float(get("min_p", 0.0)),
        frequency_penalty=float(get("frequency_penalty", 0.0)),
        presence_penalty=float(get("presence_penalty", 0.0)),
        repetition_penalty=float(get("repetition_penalty", 1.0)),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=frozenset(int(t) for t in get("stop_token_ids", [])),
        ignore_eos=bool(get("ignore_eos", False)),
        skip_special_tokens=bool(get("skip_special_tokens", True)),
        spaces_between_special_tokens=bool(get("spaces_between_special_tokens", True)),
        no_stop_trim=bool(get("no_stop_trim", False)),
        n=int(get("n", 1)),
        logit_bias={int(k): float(v) for k, v in get("logit_bias", {}).items()},
        sampling_seed=raw.get("sampling_seed"),
    )
    _verify(spec, vocab_size)
    if 0 <= spec.temperature < _SAMPLING_EPS:  # greedy, as SGLang encodes it
        spec.temperature, spec.top_k = 1.0, 1
    return spec


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


@dataclass
class SampleRow:
    """What the sampler needs from one running request."""

    spec: SamplingSpec
    output_ids: list[int]
    generator: torch.Generator | None
    banned: tuple[int, ...] = ()  # token ids masked out (EOS/stop ids before min_new_tokens)


def sample(logits: torch.Tensor, rows: list[SampleRow], top_logprobs: int = 0) -> tuple[list[int], list[float], Any]:
    """Next token of every row, its log-prob, and (if asked) the top log-probs of each row.

    logits: [rows, vocab] float32 on the engine's device; modified in place by penalties, biases and bans. Every
    tensor made here is made on that device, and each row's generator must live there too (`torch.multinomial`
    on CUDA refuses a CPU generator).
    """
    for i, row in enumerate(rows):
        _adjust_logits(logits[i], row)
    temperatures = torch.tensor([row.spec.temperature for row in rows], dtype=logits.dtype, device=logits.device)
    logprobs = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)
    tokens = logprobs.argmax(dim=-1)
    for i, row in enumerate(rows):
        if not row.spec.greedy:
            tokens[i] = _draw(logprobs[i], row.spec, row.generator)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(top_logprobs, dim=-1) if top_logprobs else None
    return tokens.tolist(), chosen.tolist(), top


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
