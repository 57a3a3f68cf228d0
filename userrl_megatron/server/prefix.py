"""Prefix cache: the KV of finished sequences (and of prompts others wait to reuse, `Scheduler._admit`), reused by
later requests that start with the same tokens.

Multi-turn rollouts resend the whole conversation every turn; with this cache a turn prefills only the tokens
added since the previous turn (the environment's reply), like SGLang's radix cache. Entries are whole sequences
(prompt + output), evicted least-recently-used beyond a token budget; an entry that is a prefix of a newer one
is dropped when the newer one is stored.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    tokens: torch.Tensor  # [n] int64
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [kv_heads, n, head_dim]


class PrefixCache:
    """Longest-common-prefix lookup over stored sequences, LRU-evicted beyond `max_tokens`."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def lookup(self, tokens: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(m, per-layer KV whose first m positions are those of tokens[:m]) for the longest stored prefix,
        keeping at least one token to compute; (0, None) when nothing matches."""
        query = torch.tensor(tokens)
        best_id, best = None, 0
        for entry_id, entry in self._entries.items():
            m = _common_prefix(entry.tokens, query)
            if m > best:
                best_id, best = entry_id, m
        best = min(best, len(tokens) - 1)
        if best_id is None or best <= 0:
            return 0, None
        self._entries.move_to_end(best_id)
        return best, self._entries[best_id].layers

    def store(self, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV of `tokens` (`layers` must be owned copies, [kv_heads, len(tokens), head_dim])."""
        if self.max_tokens <= 0 or not tokens or len(tokens) > self.max_tokens:
            return
        query = torch.tensor(tokens)
        for entry_id in [i for i, e in self._entries.items() if _common_prefix(e.tokens, query) == len(e.tokens)]:
            self.tokens -= len(self._entries.pop(entry_id).tokens)  # dominated: a prefix of the new sequence
        while self._entries and self.tokens + len(tokens) > self.max_tokens:
            self.tokens -= len(self._entries.popitem(last=False)[1].tokens)
        self._entries[self._next_id] = _Entry(query, layers)
        self._next_id += 1
        self.tokens += len(tokens)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    mismatch = (a[:n] != b[:n]).nonzero()
    return n if len(mismatch) == 0 else int(mismatch[0])
