"""Admission of episodes by whole group: the episodes of one GRPO group start together.

GRPO normalises an episode's return within its group, which assumes one policy sampled the whole group. Episodes
admitted one by one as slots free up start on different weight versions when a push lands in between, and the
advantage then partly encodes which weights sampled the episode. A `GroupGate` admits a group only when all of
its episodes can start at once.
"""

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable


class GroupGate:
    """At most `capacity` episodes in flight, admitted a whole group at a time, in arrival order.

    A group of `n` episodes waits until it can take `min(n, capacity)` slots at once. A group larger than the
    capacity therefore still runs: it takes the whole capacity, and its remaining episodes start as its own episodes
    end (their slots stay with the group until none of its episodes is left to start). Groups are admitted first
    come, first served: a later group never overtakes an earlier one still waiting, even where it would fit, so no
    group starves. Once every episode of a group has started, each one gives its slot back to the gate as it ends.
    A group cancelled while waiting or running gives back every slot it took.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a gate needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._free = capacity
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()  # (slots wanted, granted), in arrival order

    @property
    def free(self) -> int:
        """Slots no group holds."""
        return self._free

    @property
    def waiting(self) -> int:
        """Groups waiting for admission."""
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def admit(self, episodes: int) -> AsyncIterator["Admission"]:
        """Wait for the group's turn and its slots; run each of its `episodes` under the admission's `slot()`. On exit
        (also by an error or a cancellation) the slots its episodes do not occupy go back to the gate."""
        held = min(episodes, self.capacity)
        await self._take(held)
        admission = Admission(held, episodes, self._give)
        try:
            yield admission
        finally:
            admission.close()

    async def _take(self, slots: int) -> None:
        if not self._waiting and slots <= self._free:
            self._free -= slots
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (slots, granted)
        self._waiting.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # admitted, then cancelled before it could run
                self._give(slots)
            else:
                with contextlib.suppress(ValueError):  # `_wake` may have dropped it already
                    self._waiting.remove(entry)
                self._wake()  # the group at the head may have left: the next one may fit now
            raise

    def _give(self, slots: int) -> None:
        self._free += slots
        self._wake()

    def _wake(self) -> None:
        while self._waiting:
            slots, granted = self._waiting[0]
            if granted.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if slots > self._free:
                return
            self._waiting.popleft()
            self._free -= slots
            granted.set_result(None)


class Admission:
    """The slots of one admitted group; each of its episodes runs under `slot()`."""

    def __init__(self, held: int, episodes: int, give: Callable[[int], None]) -> None:
        self._held = held  # slots the group holds: occupied, or kept for an episode still to start
        self._running = 0
        self._to_start = episodes
        self._own = asyncio.Semaphore(held)
        self._give = give
        self._closed = False

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One episode's slot: taken from the group's, given back to the gate when the episode ends, or to the
        group's next episode while it has episodes still to start."""
        await self._own.acquire()
        self._to_start -= 1
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._to_start > 0 and not self._closed:
                self._own.release()
            else:
                self._held -= 1
                self._give(1)

    def close(self) -> None:
        """Give back the slots no episode occupies; an episode still running gives its own back when it ends."""
        self._closed = True
        self._give(self._held - self._running)
        self._held = self._running
