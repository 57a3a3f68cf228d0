"""Groups carried over by over-sampling survive a resume: a checkpoint saves their tasks with the task stream
(`TaskStream.state(carried)`), and the resumed run draws those first, then the stream's next tasks.

The trainer's own rollout strategy (`take`, `begin_next`, `close`), `checkpoints.save_step` and `resume` run on a
real task stream and real checkpoint directories; the groups are played by the test, which decides when each
finishes."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from userrl_megatron.config import RootConfig, load_config
from userrl_megatron.errors import RunError
from userrl_megatron.run.checkpoint_files import EXTRA_FILE, FORMAT_VERSION, META_FILE, commit, write_manifest
from userrl_megatron.trainer.driver import Trainer
from userrl_megatron.trainer.task_stream import TaskStream
from userrl_megatron.types import Episode, EpisodeGroup, Message, Task, Turn

TASKS = [Task("echo", f"t{i}", [Message("user", "hi")]) for i in range(10)]
SIGNAL, FLAT = [0.0, 1.0], [1.0, 1.0]  # episode scores of a group with / without GRPO signal


def ids(tasks: list[Task]) -> list[str]:
    return [t.task_id for t in tasks]


def test_a_restored_stream_hands_out_the_carried_tasks_first_then_its_order() -> None:
    order = ids(TaskStream(TASKS, seed=4).next(15))  # crosses an epoch boundary
    first = TaskStream(TASKS, seed=4)
    drawn = first.next(6)
    state = json.loads(json.dumps(first.state(carried=[drawn[4], drawn[1]])))  # as the checkpoint holds it
    assert state["carried"] == [
        {"index": int(order[4][1:]), "task": f"echo/{order[4]}"},
        {"index": int(order[1][1:]), "task": f"echo/{order[1]}"},
    ]
    resumed = TaskStream(TASKS, seed=4)
    resumed.restore(state)
    assert ids(resumed.next(1)) == [order[4]]
    # saved again before it handed out every carried task: the rest stay carried, after the caller's
    again = resumed.state(carried=[resumed.tasks[0]])["carried"]
    assert [e["task"] for e in again] == ["echo/t0", f"echo/{order[1]}"]
    assert ids(resumed.next(10)) == [order[1], *order[6:15]]
    assert resumed.state()["carried"] == []


def test_a_state_without_carried_tasks_restores() -> None:
    """Checkpoints written before carried tasks were saved hold no `carried`: nothing is carried."""
    order = ids(TaskStream(TASKS, seed=1).next(8))
    resumed = TaskStream(TASKS, seed=1)
    resumed.restore({"epoch": 0, "position": 3, "tasks": len(TASKS)})
    assert ids(resumed.next(5)) == order[3:8]


@pytest.mark.parametrize(
    "entry",
    [
        {"index": 10, "task": "echo/t0"},  # beyond the mixture
        {"index": 2, "task": "echo/t3"},  # another task at that index: the mixture changed
        {"task": "echo/t2"},
        "echo/t2",
        {"index": "2", "task": "echo/t2"},
    ],
)
def test_a_carried_entry_that_names_no_task_of_the_mixture_is_refused(entry: Any) -> None:
    stream = TaskStream(TASKS, seed=0)
    with pytest.raises(ValueError, match=r"carried task .* is not one of the config's training tasks"):
        stream.restore({"epoch": 0, "position": 2, "tasks": len(TASKS), "carried": [entry]})
    assert (stream.position, stream.carried) == (0, [])  # left as it was


# ---- the trainer: what a checkpoint saves and what the resumed run draws ----


class Groups:
    """Rollout groups the test finishes, with the scores it gives; `started` lists the tasks in start order."""

    def __init__(self, scores: dict[str, list[float]]) -> None:
        self.scores = scores
        self.release: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    async def run(self, task: Task, n: int) -> EpisodeGroup:
        self.started.append(task.task_id)
        await self.release.setdefault(task.task_id, asyncio.Event()).wait()
        episodes = []
        for score in self.scores[task.task_id]:
            episode = Episode(task=task, group_id=task.task_id, finish_reason="stop")
            episode.turns.append(Turn(0, 0, 0, "x", reward=score))
            episodes.append(episode)
        return EpisodeGroup(task.task_id, task, episodes)

    def finish(self, *task_ids: str) -> None:
        for task_id in task_ids:
            self.release.setdefault(task_id, asyncio.Event()).set()


class Actors:
    """The actor group's checkpoint calls: `save` writes the checkpoint directory as the ranks do, `load` returns
    its extra state."""

    def save(self, path: str, extra_state: dict[str, Any], ckpt: Any, background: bool) -> None:
        final = Path(path)
        tmp = final.parent / f".{final.name}.incomplete"
        tmp.mkdir(parents=True)
        (tmp / "model.distcp").write_bytes(bytes(8))
        (tmp / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "steps": 1}) + "\n")
        (tmp / EXTRA_FILE).write_text(json.dumps(extra_state) + "\n")
        write_manifest(tmp)
        commit(tmp, final)

    def finish_save(self, wait: bool) -> bool:
        return True

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        extra: dict[str, Any] = json.loads((Path(path) / EXTRA_FILE).read_text())
        return extra

    def load_weights(self, path: str) -> None: ...

    def export_hf(self, out_dir: str) -> str | None:
        return None


def config(tmp_path: Path, mode: str) -> RootConfig:
    return load_config(
        overrides=[
            f"run.output_dir={tmp_path}",
            "run.name=r",
            "run.total_steps=4",
            "logging.backends=[]",
            f"rollout.mode={mode}",
            "rollout.colocate=false",
            "rollout.prompts_per_step=2",
            "rollout.over_sample_groups=2",
            "rollout.n_samples_per_prompt=2",
        ]
    )


def trainer(cfg: RootConfig, groups: Groups) -> Trainer:
    tasks = TaskStream(TASKS, seed=cfg.run.seed)
    parts = SimpleNamespace(actors=Actors(), tasks=tasks, pool=None, sim_pool=None, rollout_group=groups.run)
    return Trainer(cfg, Path(cfg.run.output_dir) / cfg.run.name, parts)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_the_tasks_of_carried_groups_are_saved_and_drawn_first_after_a_resume(tmp_path: Path, mode: str) -> None:
    """Step 1 starts four groups (o0..o3 of the task order): o0 and o1 are used, o2 waits ready, o3 runs on.
    Step 1's checkpoint carries o2 and o3. In one_step_off, step 2's rollout is already running when it is taken
    (it drew o4 and o5 and took o2): the checkpoint holds the tasks' state from before that rollout started. The
    resumed run's step 2 starts o2, o3 (again: their episodes came from older weights), then o4 and o5: the
    tasks the uninterrupted run had in flight for step 2."""
    cfg = config(tmp_path, mode)
    order = ids(TaskStream(TASKS, seed=cfg.run.seed).next(8))
    groups = Groups({task_id: SIGNAL for task_id in order})

    async def first_run() -> None:
        run = trainer(cfg, groups)
        groups.finish(*order[:3])
        used, _, _ = await run.rollouts.take(1)
        assert ids([g.task for g in used]) == order[:2] and groups.started == order[:4]
        if mode == "one_step_off":
            run.rollouts.begin_next(1)  # as run_step does, before step 1 trains
            groups.finish(order[4])
            await settle()
            assert groups.started == order[:6]  # step 2's rollout drew o4 and o5, and finished with o2 and o4
            assert run.rollouts.ahead is not None and run.rollouts.ahead[0].done()
        run.checkpoints.save_step(1)
        await run.rollouts.close()

    asyncio.run(first_run())
    saved = json.loads((tmp_path / "r" / "checkpoints" / "step_1" / EXTRA_FILE).read_text())["tasks"]
    assert saved["position"] == 4
    assert [e["task"] for e in saved["carried"]] == [f"echo/{order[2]}", f"echo/{order[3]}"]

    resumed_groups = Groups({task_id: SIGNAL for task_id in order})

    async def resumed_run() -> None:
        run = trainer(cfg, resumed_groups)
        assert run.resume() == 1
        resumed_groups.finish(*order[2:6])
        used, _, metrics = await run.rollouts.take(2)
        assert resumed_groups.started == order[2:6]
        assert ids([g.task for g in used]) == order[2:4]  # the carried ones were started first
        assert metrics["rollout/groups_started"] == 4.0
        await run.rollouts.close()

    asyncio.run(resumed_run())


def test_carried_tasks_stay_saved_when_the_run_ends_with_groups_in_flight(tmp_path: Path) -> None:
    """The final checkpoint (after the groups in flight were cancelled) carries them: a longer run resumed from
    it draws them first, as the same run without the stop would have."""
    cfg = config(tmp_path, "sync")
    order = ids(TaskStream(TASKS, seed=cfg.run.seed).next(4))
    groups = Groups({order[0]: SIGNAL, order[1]: FLAT, order[2]: SIGNAL, order[3]: SIGNAL})

    async def run_and_stop() -> None:
        run = trainer(cfg, groups)
        groups.finish(*order[:3])
        await run.rollouts.take(1)
        await run.rollouts.close()  # the end of `fit`: o3 is cancelled
        run.checkpoints.save_step(1)  # as `finish` saves

    asyncio.run(run_and_stop())
    saved = json.loads((tmp_path / "r" / "checkpoints" / "step_1" / EXTRA_FILE).read_text())["tasks"]
    assert [e["task"] for e in saved["carried"]] == [f"echo/{order[3]}"]


@pytest.mark.parametrize(
    ("tasks", "error"),
    [
        ({"tasks": 10, "carried": [{"index": 3, "task": "echo/other"}]}, "the checkpoint's carried task .* is not one"),
        ({"tasks": 9, "carried": []}, "the checkpoint was taken with 9 training tasks, the config gives 10"),
    ],
)
def test_a_checkpoint_whose_tasks_the_config_lacks_stops_the_resume(
    tmp_path: Path, tasks: dict[str, Any], error: str
) -> None:
    """A stream state that does not fit the config's tasks is a RunError naming the checkpoint (one line, exit 1)."""
    cfg = config(tmp_path, "sync")
    path = tmp_path / "r" / "checkpoints" / "step_1"
    state = {"step": 1, "best": 0.0, "record": {}, "tasks": {"epoch": 0, "position": 4} | tasks}
    Actors().save(str(path), state, None, False)
    with pytest.raises(RunError, match=rf"^checkpoint {path}: {error}"):
        trainer(cfg, Groups({})).resume()
