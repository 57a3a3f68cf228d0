"""Episodes -> data-parallel shares -> micro-batches -> model inputs (pure torch; no Megatron import).

Every rank receives the same full batch and computes the same plan from the episode lengths alone, so no
communication is needed to agree on it:

  * `balance` splits episodes across data-parallel ranks, longest first onto the least-loaded rank;
  * `split_micro_batches` fills micro-batches up to `megatron.micro_batch_tokens` (first-fit decreasing),
    counting padded tokens (`b x longest`) for padded micro-batches and aligned lengths for packed ones;
  * `padded_input` lays a micro-batch out as [b, s] right-padded rows (CPU, local layer spec);
    `packed_input` concatenates it into one [1, T] row with per-sequence boundaries (THD, Transformer
    Engine), optionally keeping only this context-parallel rank's zig-zag half-chunks.

Model inputs carry, for every position, which episode (row) and which token of it the position holds, so
per-position outputs can be scattered back into rows (`to_rows`) whatever the layout.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def balance(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split episode indices into `parts` groups of near-equal total length (LPT); each group sorted."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(parts), key=lambda k: (load[k], k))
        groups[k].append(i)
        load[k] += lengths[i]
    return [sorted(g) for g in groups]


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def split_micro_batches(
    indices: Sequence[int], lengths: Sequence[int], budget: int, packed: bool, align: int = 1
) -> list[list[int]]:
    """Group `indices` into micro-batches whose token cost stays within `budget` (first-fit decreasing).

    Cost: padded -> count x longest (rounded up to `align`); packed -> sum of lengths each rounded up to `align`.
    Raises ValueError if a single episode exceeds the budget.
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    costs: list[tuple[int, int]] = []  # (count or total, longest) per batch
    for i in order:
        n = round_up(lengths[i], align)
        if n > budget:
            raise ValueError(f"episode {i} has {lengths[i]} tokens, more than megatron.micro_batch_tokens = {budget}")
        for k, (acc, longest) in enumerate(costs):
            fits = acc + n <= budget if packed else (acc + 1) * longest <= budget
            if fits:
                batches[k].append(i)
                costs[k] = (acc + n, longest) if packed else (acc + 1, longest)
                break
        else:
            batches.append([i])
            costs.append((n, n) if packed else (1, n))
    return batches


@dataclass
class ModelInput:
    """One micro-batch as the model sees it, and where each position comes from."""

    tokens: torch.Tensor  # [b, s] (padded) or [1, T] (packed), int64
    position_ids: torch.Tensor  # same shape
    labels: torch.Tensor  # the next token at each position (0 where there is none)
    row: torch.Tensor  # episode (row of the micro-batch) at each position, -1 on padding
    col: torch.Tensor  # token index inside that episode, -1 on padding
    cu_seqlens: torch.Tensor | None = None  # packed only: int32 boundaries of the (padded) sequences
    max_seqlen: int = 0  # packed only: longest (padded) sequence

    @property
    def scored(self) -> torch.Tensor:
        """Positions whose next token exists (they yield a log-prob)."""
        return self.labels >= 0

    def to(self, device: torch.device | str) -> "ModelInput":
        """The same input with every tensor on `device`."""
        return ModelInput(
            tokens=self.tokens.to(device),
            position_ids=self.position_ids.to(device),
            labels=self.labels.to(device),
            row=self.row.to(device),
            col=self.col.to(device),
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
        )


def padded_input(seqs: Sequence[Sequence[int]], align: int = 1) -> ModelInput:
    """Right-padded rows [b, s], s = longest rounded up to `align` (a multiple of TP under sequence parallel)."""
    width = round_up(max(len(s) for s in seqs), align)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -1, dtype=torch.long)
    row = torch.full((len(seqs), width), -1, dtype=torch.long)
    col = torch.full((len(seqs), width), -1, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids = torch.as_tensor(list(s), dtype=torch.long)
        n = len(ids)
        tokens[b, :n] = ids
        labels[b, : n - 1] = ids[1:]
        row[b, :n] = b
        col[b, :n] = torch.arange(n)
    positions = torch.arange(width).expand(len(seqs), width).contiguous()
    return ModelInput(tokens, positions, labels, row, col)


def zigzag_positions(length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions of a sequence (length a multiple of 2·cp) that context-parallel rank `cp_rank` holds:
    chunks `cp_rank` and `2·cp - 1 - cp_rank` of 2·cp equal chunks, which balances causal attention work."""
    chunk = length // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def packed_input(seqs: Sequence[Sequence[int]], align: int = 1, cp: int = 1, cp_rank: int = 0) -> ModelInput:
    """One packed row [1, T]: sequences back to back, each padded to a multiple of `align` (2·cp·tp with CP,
    tp with sequence parallel). With cp > 1 only this rank's zig-zag positions are kept (T / cp of them);
    `cu_seqlens` still describes the whole padded sequences, as Transformer Engine's THD attention expects."""
    if cp > 1 and align % (2 * cp):
        raise ValueError(f"align {align} must be a multiple of 2 x context parallel size {cp}")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("tokens", "labels", "row", "col", "pos")}
    bounds = [0]
    for b, s in enumerate(seqs):
        ids = torch.as_tensor(list(s), dtype=torch.long)
        n, padded = len(ids), round_up(len(ids), align)
        pad = padded - n
        tokens = torch.cat([ids, ids.new_zeros(pad)])
        labels = torch.cat([ids[1:], ids.new_full((pad + 1,), -1)])
        row = torch.cat([torch.full((n,), b), torch.full((pad,), -1)])
        col = torch.cat([torch.arange(n), torch.full((pad,), -1)])
        pos = torch.arange(padded)
        if cp > 1:
            keep = zigzag_positions(padded, cp, cp_rank)
            tokens, labels, row, col, pos = tokens[keep], labels[keep], row[keep], col[keep], pos[keep]
        for key, value in zip(parts, (tokens, labels, row, col, pos), strict=True):
            parts[key].append(value)
        bounds.append(bounds[-1] + padded)
    flat = {k: torch.cat(v)[None] for k, v in parts.items()}
    return ModelInput(
        tokens=flat["tokens"],
        position_ids=flat["pos"],
        labels=flat["labels"],
        row=flat["row"],
        col=flat["col"],
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in itertools.pairwise(bounds)),
    )


def to_rows(values: torch.Tensor, inp: ModelInput, rows: int, width: int) -> torch.Tensor:
    """Scatter per-position values (the score of each position's next token) into [rows, width]: the value
    at position (row r, token t) lands at column t + 1, the token it scores; everything else is 0."""
    keep = inp.scored & (inp.row >= 0)
    flat_index = inp.row[keep] * width + inp.col[keep] + 1
    out = values.new_zeros(rows * width)
    out = out.index_put((flat_index,), values[keep])
    return out.view(rows, width)


def trained_positions(inp: ModelInput, mask: torch.Tensor) -> tuple[torch.Tensor, ModelInput] | None:
    """The positions whose next token is trained (`mask` [rows, width]: 1 at trained tokens, as `to_rows` lays
    them out): their indices into the model's hidden states flattened from [s, b], and `inp` cut down to them
    as one row [1, k], in the same order. None when no position is trained."""
    scored = inp.scored & (inp.row >= 0)
    keep = torch.zeros_like(scored)
    keep[scored] = mask[inp.row[scored], inp.col[scored] + 1] > 0
    if not keep.any():
        return None
    b, s = inp.tokens.shape
    index = torch.arange(s * b).view(s, b).t()[keep]
    return index, ModelInput(
        tokens=inp.tokens[keep][None],
        position_ids=inp.position_ids[keep][None],
        labels=inp.labels[keep][None],
        row=inp.row[keep][None],
        col=inp.col[keep][None],
    )


def rows_tensor(lists: Sequence[Sequence[float]], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ragged per-token lists -> a right-padded [len(lists), width] tensor (zeros beyond each list)."""
    out = torch.zeros(len(lists), width, dtype=dtype)
    for b, values in enumerate(lists):
        out[b, : len(values)] = torch.as_tensor(list(values), dtype=dtype)
    return out
