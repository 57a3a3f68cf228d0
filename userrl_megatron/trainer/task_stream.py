"""The training task order: shuffled per epoch from the seed, resumable from a small JSON state."""

import random
from collections.abc import Sequence
from typing import Any

from userrl_megatron.types import Task


class TaskStream:
    """Hands out tasks in batches, epoch after epoch; `state()` / `restore()` make a resumed run see the same
    order it would have seen without the interruption (data already used is never repeated within an epoch).

    Tasks handed out but not trained on yet (the groups over-sampling carries to a later step) go into the state
    too, as `carried`; a restored stream hands them out again first, then goes on with the order."""

    def __init__(self, tasks: list[Task], seed: int, shuffle: bool = True) -> None:
        if not tasks:
            raise ValueError("the training mixture has no tasks")
        self.tasks, self.seed, self.shuffle = tasks, seed, shuffle
        self.epoch, self.position = 0, 0
        self.carried: list[Task] = []  # restored: handed out again before the order goes on
        self._order = self._order_of(0)
        self._index = {id(task): i for i, task in enumerate(tasks)}  # a task's place in the mixture

    def next(self, count: int) -> list[Task]:
        """The next `count` tasks: the restored carried ones first, then the order; an epoch boundary starts a
        new shuffled order."""
        out, self.carried = self.carried[:count], self.carried[count:]
        while len(out) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            out.append(self.tasks[self._order[self.position]])
            self.position += 1
        return out

    def state(self, carried: Sequence[Task] = ()) -> dict[str, Any]:
        """The position in the order, and the tasks to hand out first after `restore`: `carried` (tasks of this
        stream handed out but not trained on), then the restored ones not handed out again yet. Each carried task
        is saved as its index in the mixture and its `gym/task_id`."""
        entries = [{"index": self._index_of(task), "task": _name(task)} for task in [*carried, *self.carried]]
        return {"epoch": self.epoch, "position": self.position, "tasks": len(self.tasks), "carried": entries}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a state without `carried`, from an older checkpoint, carries nothing). A state
        taken with another number of tasks, or whose carried entries are not tasks of this mixture, is refused
        (ValueError)."""
        if state.get("tasks") != len(self.tasks):
            raise ValueError(
                f"the checkpoint was taken with {state.get('tasks')} training tasks, the config gives {len(self.tasks)}"
            )
        carried = [self._carried_task(entry) for entry in state.get("carried", [])]
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)
        self.carried = carried

    def _index_of(self, task: Task) -> int:
        index = self._index.get(id(task))
        if index is None:
            raise ValueError(f"task {_name(task)} was not handed out by this task stream")
        return index

    def _carried_task(self, entry: Any) -> Task:
        """The task a saved carried entry names; ValueError unless it names one of this mixture's tasks."""
        index = entry.get("index") if isinstance(entry, dict) else None
        if type(index) is not int or not 0 <= index < len(self.tasks) or entry.get("task") != _name(self.tasks[index]):
            raise ValueError(f"the checkpoint's carried task {entry!r} is not one of the config's training tasks")
        return self.tasks[index]

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order


def _name(task: Task) -> str:
    return f"{task.gym}/{task.task_id}"
