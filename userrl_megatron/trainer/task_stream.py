"""The training task order: shuffled per epoch from the seed, resumable from a small JSON state."""

import random
from typing import Any

from userrl_megatron.types import Task


class TaskStream:
    """Hands out tasks in batches, epoch after epoch; `state()` / `restore()` make a resumed run see the same
    order it would have seen without the interruption (data already used is never repeated within an epoch)."""

    def __init__(self, tasks: list[Task], seed: int, shuffle: bool = True) -> None:
        if not tasks:
            raise ValueError("the training mixture has no tasks")
        self.tasks, self.seed, self.shuffle = tasks, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def next(self, count: int) -> list[Task]:
        """The next `count` tasks; an epoch boundary starts a new shuffled order."""
        out: list[Task] = []
        while len(out) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            out.append(self.tasks[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "tasks": len(self.tasks)}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("tasks") != len(self.tasks):
            raise ValueError(
                f"the checkpoint was taken with {state.get('tasks')} training tasks, the config gives {len(self.tasks)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order
