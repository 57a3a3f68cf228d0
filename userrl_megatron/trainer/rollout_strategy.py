"""Where a step's rollout comes from and when it runs: one strategy per `rollout.mode`, chosen once
(`rollout_strategy`), so that `Trainer.run_step` reads as the synchronous sequence.

Invariant: `state_dict()` is the task stream as it was before every rollout not trained on yet drew its tasks (or
took carried groups), so a run resumed from a checkpoint taken at any point of a step generates those episodes
again.

- `SyncRollout` (`rollout.mode: sync`): a step's rollout runs when the step takes it; nothing runs while it trains.
- `OneStepOff`: step N + 1's rollout starts as soon as step N has taken its own (`begin_next`) and runs while N
  trains. It finishes before N's weights go to the engines (`before_push`), so its turns lag the trainer by at most
  one version. With `rollout.partial` the push does not wait: it aborts the turns in flight, which are generated
  again on the new weights.

Either takes `rollout.prompts_per_step` fresh tasks a step, or with `rollout.over_sample_groups` the first groups
with signal of a `GroupStream` (groups in flight across steps; carried ones can lag more, `rollout.max_staleness`
bounds that in the trainer).
"""

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from userrl_megatron.config.schema import RootConfig
from userrl_megatron.trainer.components import Components
from userrl_megatron.trainer.drills import Drills
from userrl_megatron.trainer.group_stream import GroupStream
from userrl_megatron.types import EpisodeGroup

Rollout = tuple[list[EpisodeGroup], list[EpisodeGroup], dict[str, float]]  # groups to train on, finished, metrics


class SyncRollout:
    """`rollout.mode: sync`: each step's rollout runs when the step takes it."""

    def __init__(
        self, cfg: RootConfig, parts: Components, drills: Drills, has_signal: Callable[[EpisodeGroup], bool]
    ) -> None:
        self.cfg, self.parts, self.drills = cfg, parts, drills
        self.stream: GroupStream | None = None  # rollout.over_sample_groups: groups in flight across steps
        if cfg.rollout.over_sample_groups:
            n = cfg.rollout.n_samples_per_prompt
            self.stream = GroupStream(
                lambda task: parts.rollout_group(task, n),
                parts.tasks.next,
                cfg.rollout.prompts_per_step,
                cfg.rollout.over_sample_groups,
                has_signal,
            )

    async def take(self, step: int) -> Rollout:
        """Step `step`'s rollout."""
        return await self.collect(step)

    def begin_next(self, step: int) -> None:
        """Step `step` has taken its rollout: in sync mode nothing starts ahead."""

    async def before_push(self) -> None:
        """The engines are about to get new weights: in sync mode no rollout is running."""

    async def collect(self, step: int) -> Rollout:
        """The groups to train on, the groups that finished (for the step's rollout statistics) and metrics: with
        `rollout.over_sample_groups` the first groups with signal (`GroupStream`), else all of them."""
        started = time.perf_counter()
        cfg = self.cfg.rollout
        if self.stream is None:
            tasks = self.parts.tasks.next(cfg.prompts_per_step)  # drawn before the first await: see `begin_next`
        await self.drills.during_rollout(step)
        if self.stream is None:
            groups = await self.parts.rollout(tasks, cfg.n_samples_per_prompt)
            used, finished, metrics = groups, groups, dict[str, float]()
        else:
            used, finished, metrics = await self.stream.collect()
        return used, finished, metrics | {"timing/rollout": time.perf_counter() - started}

    def state_dict(self) -> dict[str, Any]:
        """The task stream's state now, with the tasks of the groups carried over by over-sampling (started, not
        yet trained on): a resumed run draws those first."""
        return self.parts.tasks.state(self.stream.carried() if self.stream is not None else [])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the task stream of a checkpoint (ValueError: another training mixture than the checkpoint's)."""
        self.parts.tasks.restore(state)

    async def close(self) -> None:
        """Cancel the rollouts still running (carried groups at the end of the run, or the run stopped)."""
        if self.stream is not None:
            await self.stream.close()


class OneStepOff(SyncRollout):
    """`rollout.mode: one_step_off`: the next step's rollout runs on the engines while this step trains."""

    def __init__(
        self, cfg: RootConfig, parts: Components, drills: Drills, has_signal: Callable[[EpisodeGroup], bool]
    ) -> None:
        super().__init__(cfg, parts, drills, has_signal)
        # the next step's rollout running in the background, and the tasks' state before its draw
        self.ahead: tuple[asyncio.Task[Rollout], dict[str, Any]] | None = None

    async def take(self, step: int) -> Rollout:
        """Step `step`'s rollout: the one started ahead (started now at the first step)."""
        if self.ahead is None:
            self.begin(step)
        assert self.ahead is not None
        job, self.ahead = self.ahead[0], None
        return await job

    def begin_next(self, step: int) -> None:
        """Start step `step + 1`'s rollout, unless `step` is the run's last."""
        if step < self.cfg.run.total_steps:
            self.begin(step + 1)

    def begin(self, step: int) -> None:
        """Start step `step`'s rollout in the background. A checkpoint taken meanwhile saves the tasks' state as
        it was before this rollout drew its tasks or took carried groups."""
        before = super().state_dict()
        self.ahead = (asyncio.create_task(self.collect(step)), before)

    async def before_push(self) -> None:
        """The engines finish the next step's episodes before the push (with `rollout.partial`, not: the push
        aborts the turns in flight)."""
        if self.ahead is not None and not self.cfg.rollout.partial:
            await asyncio.wait([self.ahead[0]])

    def state_dict(self) -> dict[str, Any]:
        """The tasks' state from before the rollout running ahead drew its tasks, if one runs."""
        return self.ahead[1] if self.ahead is not None else super().state_dict()

    async def close(self) -> None:
        if self.ahead is not None:
            job, self.ahead = self.ahead[0], None
            job.cancel()
            with contextlib.suppress(BaseException):
                await job
        await super().close()


def rollout_strategy(
    cfg: RootConfig, parts: Components, drills: Drills, has_signal: Callable[[EpisodeGroup], bool]
) -> SyncRollout:
    """The strategy `rollout.mode` names (`rollout.partial` and over-sampling are its settings)."""
    kind = OneStepOff if cfg.rollout.mode == "one_step_off" else SyncRollout
    return kind(cfg, parts, drills, has_signal)
