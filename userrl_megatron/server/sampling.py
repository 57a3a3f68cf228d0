"""SGLang `sampling_params`: validation with SGLang's messages, and batched sampling with its log-prob semantics.

Log-probs are those of `softmax(logits / temperature)` before top-k/top-p/min-p truncation; greedy requests
(temperature 0, which SGLang turns into temperature 1 with top_k 1) get the raw `log_softmax(logits)`.
"""

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from userrl_megatron.server.grammar import apply_bitmasks, grammar_key

_SAMPLING_EPS = 1e-6
MAX_STOP_COUNT = 32  # SGLang 0.5.23's limit on stop strings
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value; a larger one overflows float32 logits to inf/nan
MAX_N = 128  # OpenAI's largest n; each sample is a request of its own
# Keys SGLang accepts that this engine cannot honour: refused with a clear message instead of being ignored.
UNSUPPORTED_KEYS = ("stop_regex", "custom_params", "watermark")


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
    grammar: tuple[str, str] | None = None  # (kind, spec): json_schema, regex or ebnf (`grammar.py`)

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
        grammar=grammar_key(raw),
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
    grammar: Any = None  # the request's xgrammar GrammarMatcher: its bitmask limits the row's next token


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
    tensor made here is made on that device, and each row's generator must live there too (a CUDA draw
    refuses a CPU generator). A row whose own settings make a step raise fails alone (`Sampled.failed`):
    every other row of the batch is sampled as if it had not been there.

    One step is a fixed set of batched ops over all rows, with one host-to-device copy of the rows' settings and
    one device-to-host copy of the tokens and their log-probs (no per-row synchronisation). A row with a grammar
    has its logits masked, after those edits, to the tokens its grammar allows next (`grammar.apply_bitmasks`);
    the log-probs are those of the masked logits, as SGLang's. A sampled row inverts
    its distribution's CDF at one uniform draw `u` (`_invert`): a row with a generator of its own (a
    `sampling_seed`) draws its `u` from it alone, so its tokens do not depend on the rest of the batch.
    """
    vocab = logits.shape[-1]
    settings = _Settings()
    failed: dict[int, Exception] = {}
    for i, row in enumerate(rows):
        try:
            settings.add(i, row, vocab)
        except Exception as e:
            failed[i] = e
    drawing = [i for i, row in enumerate(rows) if not row.spec.greedy and i not in failed]
    groups: dict[int, list[int]] = {}  # rows by the generator they draw from (None: torch's default)
    for i in drawing:
        groups.setdefault(id(rows[i].generator), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            settings.drawn_together += members
    per_row, penalized, biased, banned, together = settings.upload(logits.device)

    _edit_logits(logits, per_row, penalized, biased, banned)
    if any(row.grammar is not None for row in rows):
        try:
            apply_bitmasks(logits, [row.grammar for row in rows])
        except Exception as e:  # a matcher that refuses fails the grammar rows, never the others
            failed.update({i: e for i, row in enumerate(rows) if row.grammar is not None})
    temperatures = per_row[:, 0].to(logits.dtype)
    logprobs = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)
    invalid = None
    if drawing:
        probs = _truncate(
            logprobs.exp(),
            per_row[:, 1].long(),
            per_row[:, 2],
            per_row[:, 3],
            by_rank=any(0 < rows[i].spec.top_k < vocab or rows[i].spec.top_p < 1.0 for i in drawing),
            by_min_p=any(rows[i].spec.min_p > 0.0 for i in drawing),
        )
        u = _uniforms([(rows[m[0]].generator, m) for m in groups.values()], together, len(rows), failed, probs.device)
        tokens, invalid = _invert(probs, u)
        if len(drawing) < len(rows):  # greedy rows (top_k 1 is how greedy requests are encoded) take the argmax
            tokens = torch.where(per_row[:, 1] == 1, logprobs.argmax(dim=-1), tokens)
    else:
        tokens = logprobs.argmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = min(top_logprobs, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    columns = [tokens, chosen] if invalid is None else [tokens, chosen, invalid]
    host = torch.stack([c.to(torch.float64) for c in columns]).tolist()  # the step's one device-to-host copy
    if invalid is not None:
        for i in drawing:
            if host[2][i] and i not in failed:  # torch.multinomial's message, as before
                failed[i] = RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    return Sampled([int(t) for t in host[0]], host[1], top, failed)


_COLUMNS = 7  # per row: temperature, top_k (vocab when off), top_p, min_p, repetition, frequency, presence penalty


@dataclass
class _Settings:
    """One step's per-row settings and sparse logit edits, gathered on the host and sent to the device in one copy."""

    per_row: list[float] = field(default_factory=list)  # _COLUMNS values a row
    penalized: list[float] = field(default_factory=list)  # (row, token id, count) of tokens output so far
    biased: list[float] = field(default_factory=list)  # (row, token id, bias)
    banned: list[float] = field(default_factory=list)  # (row, token id)
    drawn_together: list[float] = field(default_factory=list)  # rows sharing a generator, group after group

    def add(self, i: int, row: SampleRow, vocab: int) -> None:
        """Row i's settings; raises, adding no edits, when one of its token ids is outside the vocabulary."""
        spec = row.spec
        top_k = spec.top_k if 0 < spec.top_k < vocab else vocab
        self.per_row += (spec.temperature, top_k, spec.top_p, spec.min_p)
        self.per_row += (spec.repetition_penalty, spec.frequency_penalty, spec.presence_penalty)
        counts = Counter(row.output_ids) if spec.needs_penalties else Counter()
        for ids in (counts, spec.logit_bias, row.banned):
            for token_id in ids:
                if not 0 <= token_id < vocab:  # one bad id must not fail the batched index ops of every row
                    raise IndexError(f"index {token_id} is out of bounds for dimension 0 with size {vocab}")
        for token_id, count in counts.items():
            self.penalized += (i, token_id, count)
        for token_id, bias in spec.logit_bias.items():
            self.biased += (i, token_id, bias)
        for token_id in row.banned:
            self.banned += (i, token_id)

    def upload(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(per_row [rows, _COLUMNS], penalized [n, 3], biased [n, 3], banned [n, 2], drawn_together [n]) on
        `device`, float64 (exact for token ids and counts) but `drawn_together`, made long for indexing."""
        parts = (self.per_row, self.penalized, self.biased, self.banned, self.drawn_together)
        flat = torch.tensor([x for part in parts for x in part], dtype=torch.float64)
        if device.type == "cuda" and torch.cuda.is_available():  # from pinned memory the copy does not wait
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        per_row, penalized, biased, banned, together = flat.split([len(part) for part in parts])
        return (
            per_row.view(-1, _COLUMNS),
            penalized.view(-1, 3),
            biased.view(-1, 3),
            banned.view(-1, 2),
            together.long(),
        )


def _edit_logits(
    logits: torch.Tensor, per_row: torch.Tensor, penalized: torch.Tensor, biased: torch.Tensor, banned: torch.Tensor
) -> None:
    """Penalties on the tokens output so far, then `logit_bias`, then the banned ids at -inf, in place."""
    if penalized.shape[0]:
        rows, ids = penalized[:, 0].long(), penalized[:, 1].long()
        repetition, frequency, presence = per_row[rows, 4:].to(logits.dtype).unbind(1)
        picked = logits[rows, ids]
        picked = torch.where(picked > 0, picked / repetition, picked * repetition)
        logits[rows, ids] = picked - frequency * penalized[:, 2].to(logits.dtype) - presence
    if biased.shape[0]:  # unique (row, id) pairs: a plain indexed add (CUDA's accumulating index_put_ syncs)
        rows, ids = biased[:, 0].long(), biased[:, 1].long()
        logits[rows, ids] += biased[:, 2].to(logits.dtype)
    if banned.shape[0]:
        logits[banned[:, 0].long(), banned[:, 1].long()] = float("-inf")


def _truncate(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    by_rank: bool,
    by_min_p: bool,
) -> torch.Tensor:
    """`probs` [rows, vocab] with the tokens each row's top_k (in [1, vocab]), then top_p, then min_p ([rows]
    each) drop set to 0, in place where it can.

    top_k keeps the tokens at least as likely as the k-th, ties included. top_p drops a token when the mass ranked
    before it (by probability, ties by token id) exceeds top_p × the mass top_k kept. min_p drops a token less
    likely than min_p × the row's most likely one. `by_rank` / `by_min_p` say whether any row needs them.
    """
    if by_rank:
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        ranked.masked_fill_(ranked < ranked.gather(1, top_k.unsqueeze(1) - 1), 0.0)
        top_p = top_p.to(probs.dtype).unsqueeze(1)
        before = ranked.cumsum(dim=-1).sub_(ranked)
        limit = torch.where(top_p < 1.0, top_p * ranked.sum(dim=-1, keepdim=True), math.inf)
        ranked.masked_fill_(before > limit, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, ranked)
    if by_min_p:
        threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def _uniforms(
    groups: list[tuple[torch.Generator | None, list[int]]],
    together: torch.Tensor,
    rows: int,
    failed: dict[int, Exception],
    device: torch.device,
) -> torch.Tensor:
    """[rows] float64 draws, uniform on [0, 1), each group's rows from its generator (rows in no group get 0).

    A row alone with its generator draws exactly one value from it, wherever it sits in the batch; a group of rows
    sharing one draws them in one op, its rows indexed by its span of `together`. A generator that refuses (one
    on another device) fails its own rows.
    """
    u, start = torch.zeros(rows, dtype=torch.float64, device=device), 0
    for generator, members in groups:
        try:
            if len(members) == 1:
                u[members[0]] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)[0]
            else:
                span = together[start : start + len(members)]
                start += len(members)
                u.index_copy_(
                    0, span, torch.rand(len(members), generator=generator, dtype=torch.float64, device=device)
                )
        except Exception as e:
            failed.update(dict.fromkeys(members, e))
    return u


def _invert(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each row, rows whose probabilities are not a distribution): the first token whose cumulative
    mass exceeds `u` × the row's mass, as `torch.multinomial` draws on CPU.

    The cumulative sum is float64, so every token's share of [0, mass) is its probability to ~1e-16 however large
    the vocabulary; the target stays below the mass, so a token of zero probability is never the one found. NaN
    probabilities (inf or NaN logits survive truncation) make the row's mass NaN."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    mass = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * mass, mass.nextafter(torch.zeros_like(mass)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    return tokens, ~(mass.squeeze(1) > 0)
