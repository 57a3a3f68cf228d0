"""GroupGate: a group's episodes start together, groups in arrival order, slots freed per episode and on cancellation.

Episodes here run until the test ends them; the event loop is left to settle between steps, nothing is timed.
"""

import asyncio

import pytest

from userrl_megatron.config.schema import RolloutConfig
from userrl_megatron.observability.progress import HEARTBEAT_S
from userrl_megatron.rollout.admission import Admission, GroupGate
from userrl_megatron.rollout.episode import EpisodeRunner, TurnEngine
from userrl_megatron.types import Episode, Message, SamplingParams, Task
from userrl_megatron.wire.generation import Generation


async def settle() -> None:
    """Let every task that can move run until it waits again."""
    for _ in range(20):
        await asyncio.sleep(0)


class Groups:
    """Groups of episodes under one gate; an episode runs until the test ends it."""

    def __init__(self, gate: GroupGate) -> None:
        self.gate = gate
        self.admitted: list[str] = []  # groups, in the order admitted
        self.started: list[str] = []  # episodes ("a0", "a1", ...), in the order started
        self.ends: dict[str, asyncio.Event] = {}

    def start(self, name: str, episodes: int) -> asyncio.Task[None]:
        return asyncio.create_task(self.run(name, episodes))

    async def run(self, name: str, episodes: int) -> None:
        async with self.gate.admit(episodes) as admission:
            self.admitted.append(name)
            await asyncio.gather(*(self.episode(admission, f"{name}{i}") for i in range(episodes)))

    async def episode(self, admission: Admission, name: str) -> None:
        async with admission.slot():
            self.started.append(name)
            await self.ends.setdefault(name, asyncio.Event()).wait()

    async def end(self, *names: str) -> None:
        for name in names:
            self.ends.setdefault(name, asyncio.Event()).set()
        await settle()


def test_a_group_waits_until_all_its_slots_are_free() -> None:
    async def scenario() -> None:
        groups = Groups(GroupGate(4))
        a = groups.start("a", 3)
        await settle()
        b = groups.start("b", 3)
        await settle()
        assert groups.started == ["a0", "a1", "a2"] and groups.gate.free == 1 and groups.gate.waiting == 1
        await groups.end("a0")
        assert groups.started == ["a0", "a1", "a2"] and groups.gate.free == 2  # one slot more is not enough
        await groups.end("a1")
        assert groups.started[3:] == ["b0", "b1", "b2"] and groups.gate.free == 0
        await groups.end("a2", "b0", "b1", "b2")
        await asyncio.gather(a, b)
        assert groups.gate.free == 4

    asyncio.run(scenario())


def test_groups_are_admitted_in_arrival_order() -> None:
    async def scenario() -> None:
        groups = Groups(GroupGate(4))
        jobs = [groups.start("a", 4)]
        await settle()
        jobs += [groups.start("b", 3), groups.start("c", 1)]
        await settle()
        await groups.end("a0")
        assert groups.admitted == ["a"]  # c would fit in the free slot, but b came first
        await groups.end("a1", "a2")
        assert groups.admitted == ["a", "b"] and groups.gate.waiting == 1
        await groups.end("a3")
        assert groups.admitted == ["a", "b", "c"]
        await groups.end("b0", "b1", "b2", "c0")
        await asyncio.gather(*jobs)
        assert groups.gate.free == 4

    asyncio.run(scenario())


def test_a_group_larger_than_the_gate_takes_it_whole_and_still_completes() -> None:
    async def scenario() -> None:
        groups = Groups(GroupGate(4))
        big = groups.start("a", 6)
        await settle()
        small = groups.start("b", 1)
        await settle()
        assert groups.started == ["a0", "a1", "a2", "a3"] and groups.gate.free == 0
        await groups.end("a0", "a1")  # their slots go to the group's own episodes still to start, not to b
        assert groups.started == ["a0", "a1", "a2", "a3", "a4", "a5"] and groups.admitted == ["a"]
        await groups.end("a2")  # every episode of a has started: the slot goes back to the gate
        assert groups.admitted == ["a", "b"]
        await groups.end("a3", "a4", "a5", "b0")
        await asyncio.gather(big, small)
        assert groups.gate.free == 4

    asyncio.run(scenario())


def test_a_finished_episode_frees_its_slot_at_once() -> None:
    """A group's finished episodes do not hold their slots while its slow ones run."""

    async def scenario() -> None:
        groups = Groups(GroupGate(4))
        a = groups.start("a", 3)
        await settle()
        b = groups.start("b", 2)
        await settle()
        await groups.end("a0")
        assert groups.started == ["a0", "a1", "a2", "b0", "b1"]  # a1 and a2 still run
        await groups.end("a1", "a2", "b0", "b1")
        await asyncio.gather(a, b)
        assert groups.gate.free == 4

    asyncio.run(scenario())


def test_a_group_cancelled_while_waiting_leaves_its_place() -> None:
    async def scenario() -> None:
        groups = Groups(GroupGate(4))
        a = groups.start("a", 3)
        await settle()
        b = groups.start("b", 4)
        await settle()
        c = groups.start("c", 1)
        await settle()
        assert groups.admitted == ["a"] and groups.gate.waiting == 2  # c fits, but waits behind b
        b.cancel()
        await settle()
        assert groups.admitted == ["a", "c"] and groups.gate.waiting == 0
        await groups.end("a0", "a1", "a2", "c0")
        await asyncio.gather(a, c)
        assert b.cancelled() and groups.gate.free == 4

    asyncio.run(scenario())


def test_a_group_cancelled_while_running_gives_back_every_slot() -> None:
    async def scenario() -> None:
        groups = Groups(GroupGate(4))
        a = groups.start("a", 6)
        await settle()
        await groups.end("a0")  # a4 takes its slot; a5 waits for one of the group's
        b = groups.start("b", 2)
        await settle()
        a.cancel()
        await settle()
        assert a.cancelled() and groups.admitted == ["a", "b"] and groups.gate.free == 2
        await groups.end("b0", "b1")
        await b
        assert groups.gate.free == 4 and groups.gate.waiting == 0

    asyncio.run(scenario())


def test_a_group_cancelled_once_admitted_but_before_it_ran_gives_its_slots_back() -> None:
    async def scenario() -> None:
        gate = GroupGate(4)
        groups = Groups(gate)
        async with gate.admit(4):
            b = groups.start("b", 2)
            await settle()
            assert gate.waiting == 1
        b.cancel()  # leaving the block admitted b; its task has not run since
        await settle()
        assert b.cancelled() and groups.started == [] and gate.free == 4

    asyncio.run(scenario())


def test_a_gate_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GroupGate(0)


class Weights:
    """A weight version the test pushes; each episode records the version it started on."""

    def __init__(self) -> None:
        self.version = 0


class HeldRunner(EpisodeRunner):
    """`run_groups` over episodes that record their start and weight version and run until the test ends them."""

    def __init__(self, weights: Weights) -> None:  # no chat template or gyms: `run` is replaced
        self.cfg = RolloutConfig()
        self.heartbeat_s = HEARTBEAT_S
        self.weights = weights
        self.started: list[tuple[str, int]] = []  # (episode "a0", weight version), in the order started
        self.ends: dict[str, asyncio.Event] = {}

    async def run(
        self,
        task: Task,
        engine: TurnEngine,
        group_id: str = "",
        sampling: SamplingParams | None = None,
        episode_id: str = "",
    ) -> Episode:
        name = task.task_id + episode_id.rsplit("-", 1)[1]
        self.started.append((name, self.weights.version))
        await self.ends.setdefault(name, asyncio.Event()).wait()
        episode = Episode(task=task, group_id=group_id, finish_reason="done")
        episode.metadata["episode_id"] = episode_id
        return episode

    def names(self) -> list[str]:
        return [name for name, _ in self.started]

    async def end(self, *names: str) -> None:
        for name in names:
            self.ends.setdefault(name, asyncio.Event()).set()
        await settle()


def task(task_id: str) -> Task:
    return Task("echo", task_id, [Message("user", "hi")])


class NoEngine:
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        raise AssertionError("a held episode generates nothing")


def test_run_groups_admits_whole_groups_under_its_concurrency() -> None:
    async def scenario() -> None:
        runner = HeldRunner(Weights())
        job = asyncio.create_task(runner.run_groups([task("a"), task("b")], 3, lambda _: NoEngine(), concurrency=4))
        await settle()
        assert runner.names() == ["a0", "a1", "a2"]  # not b0 in the fourth slot
        await runner.end("a0")
        assert runner.names() == ["a0", "a1", "a2"]
        await runner.end("a1")
        assert runner.names()[3:] == ["b0", "b1", "b2"]
        await runner.end("a2", "b0", "b1", "b2")
        groups = await job
        assert [g.task.task_id for g in groups] == ["a", "b"]
        ids = [[e.metadata["episode_id"] for e in g.episodes] for g in groups]
        assert ids == [[f"{g.group_id}-{i}" for i in range(3)] for g in groups]

    asyncio.run(scenario())


def test_groups_sharing_a_gate_start_each_on_one_weight_version() -> None:
    """Three groups of 3 in flight at once under a shared gate of 4 (the trainer's over-sampling); weights are
    pushed after every episode that ends. Every group's episodes start on one version."""

    async def scenario() -> None:
        weights = Weights()
        runner = HeldRunner(weights)
        gate = GroupGate(4)
        jobs = [
            asyncio.create_task(runner.run_groups([task(name)], 3, lambda _: NoEngine(), gate=gate)) for name in "abc"
        ]
        await settle()
        for name in ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"]:
            await runner.end(name)
            weights.version += 1
        groups = [group for job in jobs for group in await job]
        versions: dict[str, set[int]] = {}
        for name, version in runner.started:
            versions.setdefault(name[0], set()).add(version)
        assert versions == {"a": {0}, "b": {1}, "c": {4}}  # b waits for a0 and a1, c for a2, b0 and b1
        assert [len(g.episodes) for g in groups] == [3, 3, 3] and gate.free == 4

    asyncio.run(scenario())


def test_cancelled_rollouts_give_back_a_shared_gate() -> None:
    """The over-sampling stream cancels the groups still in flight when a run ends: running and waiting alike."""

    async def scenario() -> None:
        runner = HeldRunner(Weights())
        gate = GroupGate(4)
        jobs = [
            asyncio.create_task(runner.run_groups([task(name)], 3, lambda _: NoEngine(), gate=gate)) for name in "ab"
        ]
        await settle()
        await runner.end("a0")
        assert runner.names() == ["a0", "a1", "a2"] and gate.waiting == 1
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        assert gate.free == 4 and gate.waiting == 0

    asyncio.run(scenario())
