"""Over-sampling with dynamic filtering: which groups a step takes, drops and carries, in completion order."""

import asyncio

from userrl_megatron.trainer.group_stream import GroupStream
from userrl_megatron.types import Episode, EpisodeGroup, Message, Task, Turn


def task(i: int) -> Task:
    return Task("echo", f"t{i}", [Message("user", "hi")])


def group(t: Task, scores: list[float]) -> EpisodeGroup:
    episodes = []
    for score in scores:
        ep = Episode(task=t, group_id=t.task_id)
        ep.turns.append(Turn(0, 0, 0, "x", reward=score))
        episodes.append(ep)
    return EpisodeGroup(t.task_id, t, episodes)


class Groups:
    """Groups that finish when the test says so, with the scores the test gives."""

    def __init__(self, scores: dict[str, list[float]]) -> None:
        self.scores = scores
        self.release: dict[str, asyncio.Event] = {}
        self.drawn = 0

    def draw(self, count: int) -> list[Task]:
        tasks = [task(self.drawn + i) for i in range(count)]
        self.drawn += count
        return tasks

    async def run(self, t: Task) -> EpisodeGroup:
        await self.release.setdefault(t.task_id, asyncio.Event()).wait()
        return group(t, self.scores[t.task_id])

    def finish(self, *ids: str) -> None:
        for i in ids:
            self.release.setdefault(i, asyncio.Event()).set()


def test_first_groups_with_signal_are_used_the_rest_dropped_or_carried() -> None:
    scores = {"t0": [1, 1], "t1": [0, 1], "t2": [1, 0], "t3": [0, 0.5], "t4": [1, 0], "t5": [0, 1], "t6": [0, 0]}
    groups = Groups(scores)

    async def scenario() -> None:
        stream = GroupStream(groups.run, groups.draw, need=2, extra=2)
        # Step 1 starts t0..t3. t0 (equal scores) and t2 finish first, then t1 and t3 together: t1 completes the
        # step, t3 is kept for the next one.
        groups.finish("t0", "t2")
        job = asyncio.create_task(stream.collect())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not job.done()  # one group with signal so far: the step waits
        groups.finish("t1", "t3")
        used, finished, metrics = await job
        assert [g.group_id for g in used] == ["t2", "t1"]
        assert sorted(g.group_id for g in finished) == ["t0", "t1", "t2", "t3"]
        assert metrics == {
            "rollout/groups_started": 4.0,
            "rollout/groups_used": 2.0,
            "rollout/groups_carried": 1.0,
            "rollout/groups_dropped": 1.0,
        }
        assert [t.task_id for t in stream.carried()] == ["t3"]  # ready: what a checkpoint now saves
        # Step 2: t3 waits ready, so three new groups keep four in flight; t6 has no signal, t5 finishes the step,
        # t4 is still running and carried to step 3.
        groups.finish("t6", "t5")
        used, finished, metrics = await stream.collect()
        assert [g.group_id for g in used] == ["t3", "t5"]
        assert sorted(g.group_id for g in finished) == ["t5", "t6"]
        assert (metrics["rollout/groups_started"], metrics["rollout/groups_carried"]) == (3.0, 1.0)
        assert metrics["rollout/groups_dropped"] == 1.0 and groups.drawn == 7
        assert [t.task_id for t in stream.carried()] == ["t4"]
        await stream.close()  # the run ends with t4 in flight: cancelled, its task still carried (the last save)
        assert not stream.running and [t.task_id for t in stream.carried()] == ["t4"]

    asyncio.run(scenario())


def test_a_step_without_enough_signal_takes_what_finished() -> None:
    groups = Groups({"t0": [1, 1], "t1": [0, 1], "t2": [0.5, 0.5]})

    async def scenario() -> None:
        groups.finish("t0", "t1", "t2")
        used, finished, metrics = await GroupStream(groups.run, groups.draw, need=2, extra=1).collect()
        assert [g.group_id for g in used] == ["t1"] and len(finished) == 3
        assert (metrics["rollout/groups_dropped"], metrics["rollout/groups_carried"]) == (2.0, 0.0)

    asyncio.run(scenario())


def test_signal_is_judged_on_the_episodes_the_trainer_keeps() -> None:
    """A group whose only differing episode failed in the engine has no signal once that episode is dropped: the
    stream, given the trainer's test, drops it instead of using it (it would train on nothing)."""
    from userrl_megatron.config.schema import AlgoConfig
    from userrl_megatron.trainer.batch import filter_groups, trainable_part

    groups = Groups({"t0": [0, 0, 1], "t1": [0, 1, 1]})
    algo = AlgoConfig(drop_equal_score_groups=True)

    async def run(t: Task) -> EpisodeGroup:
        finished = await groups.run(t)
        if t.task_id == "t0":
            finished.episodes[2].finish_reason = "engine_error"
        return finished

    async def scenario() -> None:
        groups.finish("t0", "t1")
        stream = GroupStream(run, groups.draw, need=2, extra=0, has_signal=lambda g: trainable_part(g, algo).has_signal)
        used, finished, metrics = await stream.collect()
        assert [g.group_id for g in used] == ["t1"] and metrics["rollout/groups_dropped"] == 1.0
        # filter_groups, the trainer's own filter, agrees: t0 is dropped there too.
        kept, dropped = filter_groups(finished, algo)
        assert [g.group_id for g in kept] == ["t1"] and dropped["batch/dropped_groups"] == 1.0

    asyncio.run(scenario())


def test_carried_tasks_are_the_ready_groups_then_those_in_flight_in_the_order_started() -> None:
    groups = Groups({"t0": [0, 1], "t1": [0, 1], "t2": [1, 0], "t3": [0, 1], "t4": [1, 1]})

    async def scenario() -> None:
        stream = GroupStream(groups.run, groups.draw, need=1, extra=4)
        groups.finish("t0", "t3", "t4")  # t0 is used, t3 waits ready, t4 (no signal) is dropped
        used, _, _ = await stream.collect()
        assert [g.group_id for g in used] == ["t0"]
        assert [t.task_id for t in stream.carried()] == ["t3", "t1", "t2"]
        drawn = groups.drawn
        await stream.close()
        assert [t.task_id for t in stream.carried()] == ["t3", "t1", "t2"] and groups.drawn == drawn

    asyncio.run(scenario())
