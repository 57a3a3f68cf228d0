"""The running batch's KV cache: one preallocated buffer per layer, rows left-padded to a shared write column.

Row r holds its `lengths[r]` cached tokens in columns [end - lengths[r], end). A decode step writes every row's
new key/value at column `end` and attends over columns [start, end] with `start = min(end - lengths)`, masking
each row's padding. So one forward serves every running request, a new request joins by copying its prefill
cache into a free row, and a finished one leaves by moving the last row into its place; no per-step
concatenation (transformers' DynamicCache copies the whole cache every step).
"""

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _WindowLayer(CacheLayerMixin):
    """One layer of the batch cache as transformers' attention sees it during one forward."""

    is_sliding = False

    def __init__(self, kv: "BatchKV", index: int):
        super().__init__()
        self.kv, self.index, self.is_initialized = kv, index, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.end - self.kv.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.kv.end - self.kv.start

    def get_max_length(self) -> int:
        return -1


class BatchKV:
    """Key/value buffers [rows, kv_heads, columns, head_dim] per layer, grown by doubling."""

    def __init__(self, num_layers: int, max_rows: int):
        self.num_layers, self.max_rows = num_layers, max_rows
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # cached tokens of each active row
        self.end = 0  # column the next token is written to
        self.start = 0  # first column of the current attention window

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def release(self) -> None:
        """Drop the buffers (only when no row is active)."""
        assert not self.lengths, "cannot release a KV cache with active rows"
        self.keys, self.values, self.end, self.start = [], [], 0, 0

    def insert(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy one sequence's keys and values ([kv_heads, length, head_dim] per layer) into a new row."""
        length = layers[0][0].shape[-2]
        if not self.keys:
            self._allocate(layers[0][0], rows=min(self.max_rows, 8), columns=max(64, 2 * length))
        if not self.lengths:  # nothing live: restart the columns at this row's length
            self.end = min(length, self.keys[0].shape[2] - 1)
        if self.rows == self.keys[0].shape[0]:
            self._reshape(rows=min(self.max_rows, 2 * self.rows), shift=0, columns=self.keys[0].shape[2])
        if length > self.end:  # the row needs more columns on the left than the buffer has: shift everyone right
            shift = length - self.end
            self._reshape(rows=self.keys[0].shape[0], shift=shift, columns=max(self.keys[0].shape[2], 2 * length))
        row = self.rows
        for i, (k, v) in enumerate(layers):
            self.keys[i][row, :, self.end - length : self.end] = k
            self.values[i][row, :, self.end - length : self.end] = v
        self.lengths.append(length)
        return row

    def remove(self, row: int) -> int | None:
        """Free `row` by moving the last row into it; returns the row that moved (None if `row` was last)."""
        last = self.rows - 1
        if row != last:
            lo = self.end - self.lengths[last]
            for buf in (*self.keys, *self.values):
                buf[row, :, lo : self.end] = buf[last, :, lo : self.end]
            self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        return last if row != last else None

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of one row's live keys and values per layer, [kv_heads, length, head_dim]."""
        lo = self.end - self.lengths[row]
        return [
            (k[row, :, lo : self.end].clone(), v[row, :, lo : self.end].clone())
            for k, v in zip(self.keys, self.values, strict=True)
        ]

    def begin_step(self) -> tuple[Cache, torch.Tensor]:
        """Make room for one new column; returns the cache view and the [rows, window + 1] attention mask."""
        if self.end == self.keys[0].shape[2]:
            lowest = self.end - max(self.lengths)
            if lowest >= self.end // 4:  # enough dead columns on the left: slide the data back
                self._reshape(rows=self.keys[0].shape[0], shift=-lowest, columns=self.keys[0].shape[2])
            else:
                self._reshape(rows=self.keys[0].shape[0], shift=0, columns=2 * self.end)
        self.start = self.end - max(self.lengths)
        device = self.keys[0].device
        first_valid = torch.tensor([self.end - n for n in self.lengths], device=device).unsqueeze(1)
        mask = (torch.arange(self.start, self.end + 1, device=device).unsqueeze(0) >= first_valid).long()
        return Cache(layers=[_WindowLayer(self, i) for i in range(self.num_layers)]), mask

    def end_step(self) -> None:
        """Account for the column written by the step."""
        self.end += 1
        self.lengths = [n + 1 for n in self.lengths]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's key/value of every row at column `end`; return the attention window."""
        rows = self.rows
        self.keys[layer][:rows, :, self.end] = k[:, :, 0]
        self.values[layer][:rows, :, self.end] = v[:, :, 0]
        window = slice(self.start, self.end + 1)
        return self.keys[layer][:rows, :, window], self.values[layer][:rows, :, window]

    def _allocate(self, like: torch.Tensor, rows: int, columns: int) -> None:
        heads, head_dim = like.shape[-3], like.shape[-1]
        shape = (rows, heads, columns, head_dim)
        # Zeros, not empty: padding columns are masked, but garbage NaNs would still poison the softmax.
        self.keys = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(self.num_layers)]
        self.end = self.start = 0

    def _reshape(self, rows: int, shift: int, columns: int) -> None:
        """New buffers of `rows` x `columns`, with the live columns moved `shift` to the right (negative: left)."""
        old_k, old_v, old_end = self.keys, self.values, self.end
        lo = old_end - max(self.lengths, default=0)
        self._allocate(old_k[0], rows, columns)
        self.end = old_end + shift
        live = self.rows
        for new, old in zip((*self.keys, *self.values), (*old_k, *old_v), strict=True):
            new[:live, :, lo + shift : self.end] = old[:live, :, lo:old_end]
