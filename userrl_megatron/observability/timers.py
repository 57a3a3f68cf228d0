"""Wall-clock timers: `with timers("rollout"): ...` accumulates seconds under timing/rollout until popped."""

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Timers:
    """Named accumulating timers; `pop()` returns {"timing/<name>": seconds} and resets them."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self._totals[name] += self._clock() - start

    def read(self) -> dict[str, float]:
        """The accumulated seconds of every timer closed since the last pop, left running."""
        return {f"timing/{k}": v for k, v in self._totals.items()}

    def pop(self) -> dict[str, float]:
        """The accumulated seconds of every timer since the last pop."""
        out = self.read()
        self._totals.clear()
        return out
