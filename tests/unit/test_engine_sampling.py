"""The embedded engine's batched sampler (`server/sampling.py`): the distribution it draws from, the tokens top-k,
top-p and min-p keep (against a per-row reference), greedy rows, seeded rows that do not depend on their batch,
a row that fails alone, and one device-to-host copy a step and no op that waits for the GPU inside it."""

import math
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.fake_cuda import CUDA, FakeCuda
from userrl_megatron.server.sampling import (
    SampleRow,
    SamplingSpec,
    _invert,
    _truncate,
    parse_sampling_params,
    sample,
)

PROBS = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]
LOGITS = torch.tensor(PROBS).log()
DRAWS = 20_000


def spec(**params: Any) -> SamplingSpec:
    return parse_sampling_params(params, LOGITS.numel())


def reference_kept(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a row keeps, one token at a time: top_k keeps those at least as likely as the k-th; top_p,
    over what top_k kept ranked by probability (ties by id), drops a token once the mass ranked before it
    exceeds top_p × that mass; min_p drops those below min_p × the most likely."""
    vocab = len(probs)
    kept = list(probs)
    if 0 < top_k < vocab:
        kth = sorted(probs, reverse=True)[top_k - 1]
        kept = [p if p >= kth else 0.0 for p in kept]
    if top_p < 1.0:
        total, before = sum(kept), 0.0
        for token in sorted(range(vocab), key=lambda t: (-kept[t], t)):
            p = kept[token]
            if before > top_p * total:
                kept[token] = 0.0
            before += p
    if min_p > 0.0:
        kept = [p if p >= min_p * max(kept) else 0.0 for p in kept]
    return {t for t, p in enumerate(kept) if p > 0.0}


def draw_many(s: SamplingSpec, generator: torch.Generator | None = None, greedy_every: int = 0) -> list[int]:
    """DRAWS tokens of LOGITS, one batched step; with `greedy_every`, greedy rows are mixed in and left out."""
    greedy = spec(temperature=0.0)
    rows = [SampleRow(greedy if greedy_every and i % greedy_every == 0 else s, [], generator) for i in range(DRAWS)]
    out = sample(LOGITS.expand(DRAWS, -1).clone(), rows)
    assert out.failed == {}
    return [t for i, t in enumerate(out.tokens) if not (greedy_every and i % greedy_every == 0)]


@pytest.mark.parametrize(
    "params, kept",
    [
        ({}, {0, 1, 2, 3, 4, 5}),
        ({"temperature": 0.5}, {0, 1, 2, 3, 4, 5}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.7}, {0, 1, 2}),  # mass before token 3: 0.75 > 0.7
        ({"min_p": 0.4}, {0, 1, 2}),  # 0.12 < 0.4 × 0.35
        ({"top_k": 5, "top_p": 0.9}, {0, 1, 2, 3}),  # before token 4: 0.87 > 0.9 × 0.95
        ({"top_k": 5, "top_p": 0.9, "min_p": 0.4}, {0, 1, 2}),
        ({"temperature": 2.0, "top_k": 4, "min_p": 0.5}, {0, 1, 2, 3}),  # at T 2 the 4th holds 0.59 of the 1st
    ],
)
@pytest.mark.parametrize("generator", ["default", "shared"])
def test_draws_follow_the_truncated_distribution(params: dict[str, Any], kept: set[int], generator: str) -> None:
    """Each token's frequency in 20,000 draws is within 5 binomial standard deviations of its probability
    (softmax(logits / T) renormalized over the kept tokens); a dropped token is never drawn. `shared`: one
    generator for every sampled row, with greedy rows in between."""
    s = spec(**params)
    weights = [p ** (1 / s.temperature) for p in PROBS]
    assert reference_kept([w / sum(weights) for w in weights], s.top_k, s.top_p, s.min_p) == kept
    if generator == "default":
        torch.manual_seed(0)
        tokens = draw_many(s)
    else:
        tokens = draw_many(s, torch.Generator().manual_seed(0), greedy_every=7)
    n, mass = len(tokens), sum(weights[t] for t in kept)
    for token in range(len(PROBS)):
        count = tokens.count(token)
        if token not in kept:
            assert count == 0, token
            continue
        p = weights[token] / mass
        assert abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (token, count, n * p)


@pytest.mark.parametrize("ties", [False, True])
def test_kept_tokens_equal_the_per_row_reference(ties: bool) -> None:
    """Random logits (with ties: a few distinct values) and random settings, 200 rows in one call."""
    gen = torch.Generator().manual_seed(1 if ties else 2)
    rows, vocab = 200, 12
    if ties:
        logits = torch.randint(0, 4, (rows, vocab), generator=gen).float() * 0.7
    else:
        logits = torch.randn(rows, vocab, generator=gen) * 2
    probs = logits.softmax(-1)
    top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen) * 0.99 + 0.01)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 0.0, torch.rand(rows, generator=gen) * 0.9)
    out = _truncate(probs.clone(), top_k, top_p.double(), min_p.double(), by_rank=True, by_min_p=True)
    split_ties = 0
    for i in range(rows):
        k, p, m, row = int(top_k[i]), float(top_p[i]), float(min_p[i]), probs[i].tolist()
        want = reference_kept(row, k, p, m)
        assert set(out[i].nonzero().flatten().tolist()) == want, (i, k, p, m)
        assert torch.equal(out[i][list(want)], probs[i][list(want)])  # kept tokens keep their probability
        nucleus = reference_kept(row, vocab, p, 0.0)
        split_ties += any(row[t] == row[u] for t in nucleus for u in set(range(vocab)) - nucleus)
    if ties:  # rows where top_k keeps more than k tokens, and where top_p keeps part of a tie
        assert sum(len(reference_kept(probs[i].tolist(), int(top_k[i]), 1.0, 0.0)) > top_k[i] for i in range(rows))
        assert split_ties > 10


@pytest.mark.parametrize(
    "probs, top_k, top_p, min_p, kept",
    [
        ([0.5, 0.25, 0.125, 0.125], 3, 1.0, 0.0, {0, 1, 2, 3}),  # the 3rd and 4th tie
        ([0.5, 0.25, 0.125, 0.125], 2, 1.0, 0.0, {0, 1}),
        ([0.5, 0.25, 0.125, 0.125], 4, 0.5, 0.0, {0, 1}),  # before token 1: 0.5, not above 0.5 × 1
        ([0.5, 0.25, 0.125, 0.125], 4, 0.75, 0.0, {0, 1, 2}),
        ([0.5, 0.25, 0.125, 0.125], 2, 0.5, 0.0, {0}),  # of top_k's 0.75: 0.5 > 0.375
        ([0.5, 0.25, 0.125, 0.125], 4, 1.0, 0.25, {0, 1, 2, 3}),  # 0.125 is exactly 0.25 × 0.5
        ([0.5, 0.25, 0.125, 0.125], 4, 1.0, 0.5, {0, 1}),
        ([0.25, 0.25, 0.25, 0.25], 4, 0.5, 0.0, {0, 1, 2}),  # a tie ranks by token id
        ([0.125, 0.125, 0.25, 0.5], 4, 0.8, 0.0, {0, 2, 3}),  # before token 0: 0.75; before token 1: 0.875
    ],
)
def test_truncation_at_exact_boundaries(
    probs: list[float], top_k: int, top_p: float, min_p: float, kept: set[int]
) -> None:
    """Probabilities exact in binary, so each comparison is decided at its boundary."""
    assert reference_kept(probs, top_k, top_p, min_p) == kept
    out = _truncate(
        torch.tensor([probs]),
        torch.tensor([top_k]),
        torch.tensor([top_p], dtype=torch.float64),
        torch.tensor([min_p], dtype=torch.float64),
        by_rank=True,
        by_min_p=True,
    )
    assert set(out[0].nonzero().flatten().tolist()) == kept


def test_drawn_tokens_stay_in_the_kept_set() -> None:
    """The same random rows drawn 300 times each in one batch: every drawn token is in the reference's kept set."""
    gen = torch.Generator().manual_seed(3)
    vocab, copies = 10, 300
    settings = [
        {"top_k": 3},
        {"top_p": 0.5},
        {"min_p": 0.3},
        {"top_k": 4, "top_p": 0.6, "min_p": 0.1, "temperature": 0.7},
        {"temperature": 1.5, "top_p": 0.8},
    ]
    logits = torch.randint(0, 3, (len(settings), vocab), generator=gen).float() + torch.randn(
        len(settings), vocab, generator=gen
    ) * (torch.arange(len(settings)) % 2).unsqueeze(1)  # rows 0, 2, 4 with ties
    specs = [parse_sampling_params(s, vocab) for s in settings]
    rows = [SampleRow(specs[i % len(specs)], [], gen) for i in range(copies * len(specs))]
    out = sample(logits.repeat(copies, 1), rows)
    for j, s in enumerate(specs):
        probs = (logits[j] / s.temperature).softmax(-1).tolist()
        kept = reference_kept(probs, s.top_k, s.top_p, s.min_p)
        drawn = {t for i, t in enumerate(out.tokens) if i % len(specs) == j}
        assert drawn <= kept and len(drawn) > 1, (j, drawn, kept)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    """Greedy rows get the first argmax (ties included) and log_softmax(logits) there, whatever rows sample
    beside them; sampled rows keep softmax(logits / T)'s log-prob of what they drew."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 5, (8, 30), generator=gen).float()  # ties for the maximum in most rows
    greedy, hot = spec(temperature=0.0), parse_sampling_params({"temperature": 1.7, "top_p": 0.9}, 30)
    rows = [SampleRow(greedy if i % 2 == 0 else hot, [], gen) for i in range(8)]
    out = sample(logits.clone(), rows, top_logprobs=3)
    assert out.failed == {}
    for i in range(8):
        scaled = logits[i] / (1.0 if i % 2 == 0 else 1.7)
        if i % 2 == 0:
            assert out.tokens[i] == int(logits[i].argmax())
        assert out.logprobs[i] == torch.log_softmax(scaled, -1)[out.tokens[i]].item()
        assert out.top.values[i].tolist() == torch.log_softmax(scaled, -1).topk(3).values.tolist()


def seeded_tokens(batch: list[SampleRow], logits: torch.Tensor, steps: int = 12) -> list[list[int]]:
    """Tokens of every row over `steps` steps of the same logits (each row's generator carried on)."""
    tokens: list[list[int]] = [[] for _ in batch]
    for _ in range(steps):
        out = sample(logits.clone(), batch)
        assert out.failed == {}
        for row, token in zip(tokens, out.tokens, strict=True):
            row.append(token)
    return tokens


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch() -> None:
    """A row with a generator of its own (a `sampling_seed`) draws the same tokens alone, at the head or the tail
    of a batch, beside greedy rows, rows sharing a generator and rows of other seeds; another seed draws others."""
    vocab = 40
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.5
    s = parse_sampling_params({"temperature": 0.9, "top_k": 30, "sampling_seed": 7}, vocab)
    greedy = parse_sampling_params({"temperature": 0.0}, vocab)

    def seeded(seed: int = 7) -> SampleRow:
        return SampleRow(s, [], torch.Generator().manual_seed(seed))

    def others() -> list[SampleRow]:
        shared = torch.Generator().manual_seed(0)
        return [SampleRow(s, [], shared), SampleRow(greedy, [], None), SampleRow(s, [], shared), seeded(8)]

    alone = seeded_tokens([seeded()], row_logits.unsqueeze(0))[0]
    companions = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6))
    at_head = seeded_tokens([seeded(), *others()], torch.cat([row_logits.unsqueeze(0), companions]))
    at_tail = seeded_tokens([*others(), seeded()], torch.cat([companions, row_logits.unsqueeze(0)]))
    assert at_head[0] == alone and at_tail[-1] == alone
    assert at_head[4] == at_tail[3]  # seed 8 also keeps its tokens
    assert seeded_tokens([seeded(8)], row_logits.unsqueeze(0))[0] != alone
    assert len(set(alone)) > 3  # a real draw, not one token over and over


def test_the_inversion_finds_the_token_whose_share_holds_u() -> None:
    """Each row's token is the first whose cumulative mass exceeds u × the row's mass (unnormalized, as truncation
    leaves it); a token of zero probability is never found, at u = 0 or at the largest u below 1; a tiny
    probability keeps its own share in a large vocabulary; NaN or zero mass marks the row invalid."""
    largest = 1.0 - 2.0**-53  # torch.rand's largest float64
    probs = torch.tensor(
        [
            [0.0, 0.25, 0.0, 0.75, 0.0],
            [0.0, 0.25, 0.0, 0.75, 0.0],
            [0.0, 0.25, 0.0, 0.75, 0.0],
            [0.0, 0.25, 0.0, 0.75, 0.0],
            [0.1, 0.1, 0.1, 0.0, 0.0],
            [0.5, float("nan"), 0.5, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    u = torch.tensor([0.0, 0.2499, 0.25, largest, 0.9, 0.5, 0.5], dtype=torch.float64)
    tokens, invalid = _invert(probs, u)
    assert tokens[:5].tolist() == [1, 1, 3, 3, 2]  # 0.9 of 0.3 is in token 2's share, [0.2, 0.3)
    assert invalid.tolist() == [False] * 5 + [True, True]
    vocab = 1 << 20
    big = torch.full((1, vocab), 1.0 / vocab)
    big[0, vocab // 2] = 1e-12  # 1e-12 of the mass, right after half of it
    start = float(big[0, : vocab // 2].double().sum() / big.double().sum())
    share = 1e-12 / float(big.double().sum())
    hits = _invert(big, torch.tensor([start + share / 2], dtype=torch.float64))[0]
    misses = [_invert(big, torch.tensor([x], dtype=torch.float64))[0] for x in (start - share / 2, start + 2 * share)]
    assert hits.item() == vocab // 2 and [m.item() for m in misses] == [vocab // 2 - 1, vocab // 2 + 1]


def test_a_row_whose_settings_raise_fails_alone() -> None:
    """An id outside the vocabulary (banned, biased) and inf logits from a repetition penalty of 0 fail their own
    rows; the others get the tokens and log-probs they get without them."""
    vocab = 20
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(6))
    good = parse_sampling_params({"temperature": 0.8, "top_p": 0.9}, vocab)
    greedy = parse_sampling_params({"temperature": 0.0, "frequency_penalty": 0.5}, vocab)
    bad_bias = SamplingSpec(logit_bias={vocab + 3: 1.0})
    inf_logits = SamplingSpec(repetition_penalty=0.0)
    rows = [
        SampleRow(good, [], torch.Generator().manual_seed(1)),
        SampleRow(greedy, [1, 2], None, banned=(vocab,)),
        SampleRow(bad_bias, [], torch.Generator().manual_seed(2)),
        SampleRow(greedy, [3, 3, 4], None),
        SampleRow(inf_logits, [int(logits[4].argmax())], torch.Generator().manual_seed(3)),
    ]
    out = sample(logits.clone(), rows, top_logprobs=2)
    assert sorted(out.failed) == [1, 2, 4]
    assert isinstance(out.failed[1], IndexError)
    assert str(out.failed[1]) == f"index {vocab} is out of bounds for dimension 0 with size {vocab}"
    assert str(out.failed[2]) == f"index {vocab + 3} is out of bounds for dimension 0 with size {vocab}"
    assert isinstance(out.failed[4], RuntimeError)
    assert str(out.failed[4]) == "probability tensor contains either `inf`, `nan` or element < 0"
    rows[0] = SampleRow(good, [], torch.Generator().manual_seed(1))
    alone = sample(logits[[0, 3]].clone(), [rows[0], rows[3]], top_logprobs=2)
    assert [out.tokens[i] for i in (0, 3)] == alone.tokens
    assert [out.logprobs[i] for i in (0, 3)] == alone.logprobs
    assert torch.equal(out.top.values[[0, 3]], alone.top.values)


def test_penalties_bias_and_bans_edit_the_logits() -> None:
    """Repetition (divide positive logits, multiply negative ones), then frequency × count and presence, then
    `logit_bias`, then the banned ids at -inf: values computed by hand."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    penalized = SamplingSpec(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    biased = SamplingSpec(logit_bias={0: 1.5, 4: -3.0}, top_k=1)
    edited = logits.clone()
    sample(edited, [SampleRow(penalized, [0, 1, 1, 3], None), SampleRow(biased, [2], None, banned=(1, 3))])
    assert edited.tolist() == [
        [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 1.0 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25, -2.0],
        [2.5, -math.inf, 1.0, -math.inf, -2.0],
    ]


class HostCopies(TorchFunctionMode):
    """Records every copy between the fake CUDA device and the host: reads of device values into Python
    (`tolist`, `item`, `bool()`, ...), `.cpu()` / `.to` / `copy_` across, and factories given host data."""

    READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__")

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda, self.to_host, self.to_device = cuda, [], []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name in self.READS and self.cuda.is_on_device(args[0]):
            self.to_host.append(name)
        elif name in ("to", "cpu", "cuda", "copy_") and isinstance(out, torch.Tensor):
            source = args[1] if name == "copy_" else args[0]
            if self.cuda.is_on_device(source) and not self.cuda.is_on_device(out):
                self.to_host.append(name)
            elif self.cuda.is_on_device(out) and not self.cuda.is_on_device(source):
                self.to_device.append(name)
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.to_device.append(name)
        return out


def test_one_step_copies_to_the_host_once() -> None:
    """Every kind of row in one batch on the (fake) GPU: greedy, seeded, the shared generator's, penalties,
    bias, bans, top-k/top-p/min-p and top log-probs. One copy up (the settings) and one copy down (`tolist` of
    tokens, log-probs and the validity flags); a CPU generator on the device fails its row alone."""
    vocab = 30
    cuda = FakeCuda()
    with cuda:
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7)).to("cuda")
        shared = torch.Generator(device="cuda").manual_seed(0)
        specs = [
            parse_sampling_params(p, vocab)
            for p in (
                {"temperature": 0.0, "frequency_penalty": 0.4},
                {"temperature": 0.8, "top_k": 10, "top_p": 0.9, "min_p": 0.05, "sampling_seed": 1},
                {"temperature": 1.2, "repetition_penalty": 1.3, "logit_bias": {"3": 2.0}},
                {"temperature": 1.0, "presence_penalty": 0.2},
                {"temperature": 0.7, "sampling_seed": 2},
            )
        ]
        rows = [
            SampleRow(specs[0], [1, 1, 2], None, banned=(5,)),
            SampleRow(specs[1], [4], torch.Generator(device="cuda").manual_seed(1)),
            SampleRow(specs[2], [3, 7], shared),
            SampleRow(specs[3], [9], shared, banned=(2, 11)),
            SampleRow(specs[4], [], torch.Generator().manual_seed(2)),  # on the host: refused by the device
            SampleRow(specs[0], [], None),
        ]
        copies = HostCopies(cuda)
        with copies:
            out = sample(logits, rows, top_logprobs=2)
        assert logits.device == CUDA and out.top.values.device == CUDA
    assert copies.to_host == ["tolist"] and copies.to_device == ["to"]
    assert list(out.failed) == [4]
    assert str(out.failed[4]) == "Expected a 'cuda' device type for generator but found 'cpu'"
    assert all(0 <= t < vocab for t in out.tokens) and out.tokens[5] == int(logits[5].argmax())


class WaitingOps(TorchDispatchMode):
    """Records the ops whose CUDA kernels read device values on the host before they return (a synchronisation
    that no copy in Python shows): the accumulating index_put_ (CUDA's sorting kernel checks the indices' range
    with `.item()`), nonzero and what is built on it, `item`."""

    WAITING = (
        "aten.nonzero",
        "aten.masked_select",
        "aten._local_scalar_dense",
        "aten.unique",
        "aten.repeat_interleave",
    )

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if name.startswith(self.WAITING) or (name.startswith("aten.index_put") and accumulate):
            self.seen.append(name)
        return func(*args, **kwargs)


def test_a_step_calls_no_op_that_waits_for_the_device() -> None:
    vocab = 40
    params = {"temperature": 0.8, "top_k": 10, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2,
              "frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {"3": 1.0, "7": -2.0}}  # fmt: skip
    sampled, greedy = parse_sampling_params(params, vocab), parse_sampling_params({"temperature": 0.0}, vocab)
    rows = [
        SampleRow(sampled if i < 4 else greedy, [1, 2, 2], torch.Generator().manual_seed(i) if i % 2 else None, (4,))
        for i in range(6)
    ]
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    edited = logits.clone()
    with WaitingOps() as ops:
        out = sample(edited, rows, top_logprobs=2)
    assert ops.seen == [] and not out.failed
    assert torch.equal(edited[:4, [3, 7]], (logits[:4, [3, 7]] + torch.tensor([1.0, -2.0])))  # no penalty on 3, 7
