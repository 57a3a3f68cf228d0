"""The RL loop: `train(cfg)` starts the components and runs `Trainer.fit`, whose body is one screen.

One step: a batch of tasks -> rollout groups (n episodes per task) -> filters -> old log-probs (when the update
is off-policy) and reference log-probs (with a KL penalty) -> advantages -> PPO/GRPO mini-batch updates -> weight
sync to the engines -> metrics, rollout dump, checkpoint, evaluation. Relaunching the same command resumes from
the run directory's `latest` checkpoint (model, optimizer, LR schedule, RNG, step, position in the task stream
and the tasks of the groups over-sampling carried), or from the newest undamaged one.

What stops a run is a `RunError` (one line, exit 1, the last good checkpoint kept): no rollout engine left,
`rollout.max_infra_failed_steps` steps in a row lost mostly to the infrastructure, a checkpoint that cannot be
written or no checkpoint that can be read.
"""

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from userrl_megatron.actors.run_lock import RunLock
from userrl_megatron.config import RootConfig, save_config
from userrl_megatron.config.resolve import resolve_config
from userrl_megatron.errors import RunError
from userrl_megatron.eval.training import write_step_evaluation
from userrl_megatron.observability import Timers, Tracker
from userrl_megatron.observability.dumps import write_episodes
from userrl_megatron.observability.progress import StepProgress
from userrl_megatron.rollout.summary import is_infra_failure, rollout_metrics
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.run.run_dir import RunDir
from userrl_megatron.trainer.batch import Prepared, bound_staleness, mini_batches, prepare_batch, trainable_part
from userrl_megatron.trainer.components import Components, start_components
from userrl_megatron.trainer.drills import Drills
from userrl_megatron.trainer.group_stream import GroupStream
from userrl_megatron.trainer.preflight import is_sft_checkpoint
from userrl_megatron.types import EpisodeGroup, TrainBatch

log = logging.getLogger(__name__)
Rollout = tuple[list[EpisodeGroup], list[EpisodeGroup], dict[str, float]]  # groups to train on, finished, metrics
SUMMARY_KEYS = (
    "rollout/reward_mean",
    "rollout/infra_failed",
    "rollout/turns_mean",
    "rollout/generated_tokens",
    "actor/loss",
    "actor/grad_norm",
    "mismatch/abs_logprob_diff",
    "eval/reward_mean",
    "sync/seconds",
    "timing/rollout",
    "timing/train",
    "timing/step",
)


class Trainer:
    """Owns the run's components; `fit()` is the RL loop."""

    def __init__(self, cfg: RootConfig, run_dir: Path, parts: Components) -> None:
        self.cfg, self.run_dir, self.parts = cfg, run_dir, parts
        self.drills = Drills(cfg.run.faults, parts.pool, parts.sim_pool)  # `run.faults`: none in a normal run
        self.run = RunDir(run_dir)
        self.tracker = Tracker(cfg.logging, run_dir, cfg.run.name, asdict(cfg), console_keys=SUMMARY_KEYS)
        self.checkpoints = CheckpointManager(self.run, cfg.checkpoint, parts.actors, self.tracker)
        self.best = float("-inf")
        self.best_pending: tuple[int, float] | None = None  # (step, score) of a best evaluation not exported yet
        self.progress = StepProgress(cfg.run.total_steps)  # `step N/total  elapsed  ETA` after each step
        self.infra_failed_steps = 0  # steps in a row lost mostly to the infrastructure
        self.started_from: Path | None = None  # the SFT checkpoint whose weights step 0 started from
        self.version = 0  # weight version of the trainer's policy (the step of its last update)
        # one_step_off: the next step's rollout running in the background, and the tasks' state before its draw
        self.ahead: tuple[asyncio.Task[Rollout], dict[str, Any]] | None = None
        self.stream: GroupStream | None = None  # rollout.over_sample_groups: groups in flight across steps
        if cfg.rollout.over_sample_groups:
            n = cfg.rollout.n_samples_per_prompt
            self.stream = GroupStream(
                lambda task: parts.rollout_group(task, n),
                parts.tasks.next,
                cfg.rollout.prompts_per_step,
                cfg.rollout.over_sample_groups,
                lambda group: trainable_part(group, cfg.algo).has_signal,
            )

    async def fit(self) -> int:
        """Train until `run.total_steps`; returns the last step."""
        cfg, parts = self.cfg, self.parts
        async with parts.handoff.actor_on_device():  # colocated: the actor holds the GPUs for this, then steps aside
            step = self.resume()
            if cfg.sync.enabled:  # the engines hold the HF weights (or colocated, none): the actor's go to them,
                await self.sync(step)  # checked before the first rollout
        if step == 0 and cfg.eval.before_training and 0 not in self.run.logged_steps():
            self.tracker.log(await self.evaluate(0), 0)  # the initial policy's score: the "before" of the run
        self.version = step  # the trainer's weights: the step of their last update
        try:
            while step < cfg.run.total_steps:
                step = await self.run_step(step + 1)
        finally:
            await self.drop_ahead()
        await self.finish(step)
        return step

    async def run_step(self, step: int) -> int:
        """One RL step. With `rollout.mode: one_step_off` the rollout of step + 1 runs on the engines while this
        step trains; it finishes before the new weights go to the engines (with `rollout.partial` the push comes
        at once: the turns in flight are aborted and generated again on the new weights), so its turns lag the
        trainer by at most one version (`rollout/staleness_*`), which the truncated importance weights correct.
        Groups carried over by `rollout.over_sample_groups` can lag more: `rollout.max_staleness` bounds that."""
        cfg, parts = self.cfg, self.parts
        timers, metrics = Timers(), dict[str, float]()
        with timers("step"):
            with timers("rollout_wait"):
                groups, finished, metrics = await self.take_rollout(step)
            self.dump_rollouts(step, finished)
            await self.drills.after_rollout(step)
            if cfg.rollout.mode == "one_step_off" and step < cfg.run.total_steps:
                self.start_rollout(step + 1)
            bound = cfg.rollout.max_staleness if cfg.sync.enabled else None  # else the engines keep version 0
            fresh, stale = bound_staleness(groups, self.version, bound)
            metrics |= stale
            prepared = self.prepare(fresh, step, finished)
            if prepared is not None:
                await parts.handoff.enter_training()
                self.export_best()  # the weights the last evaluation scored, before this update changes them
                if self.needs_scoring():
                    with timers("logprobs"):
                        await self.score(prepared.batch)
                with timers("train"):
                    metrics |= await self.update(prepared.batch, step)
                self.version = step
                metrics |= prepared.metrics  # the actor reports the rollout/trainer mismatch/*
                if self.checkpoint_due(step):  # inside the training window: the engines' weights are pushed next
                    with timers("checkpoint"):  # (the record: what the step knows so far, its rollout and update)
                        self.save(step, self.step_record(finished, metrics | timers.read()))
            if self.ahead is not None and not cfg.rollout.partial:
                with timers("rollout_wait"):  # the engines finish the next step's episodes before the push
                    await asyncio.wait([self.ahead[0]])
            if prepared is not None:
                if cfg.sync.enabled:
                    with timers("sync"):
                        metrics |= await self.sync(step)
                await parts.handoff.enter_rollout()
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
                with timers("eval"):
                    metrics |= await self.evaluate(step)
        metrics = self.summarize(finished, metrics | timers.pop())
        if prepared is None and self.checkpoint_due(step):  # no training window this step
            with timers("checkpoint"):
                async with parts.handoff.actor_on_device():
                    self.save(step, metrics)
            metrics |= timers.pop()
        self.checkpoints.commit(wait=False)
        self.drills.before_log(step, self.checkpoints)
        self.tracker.log(metrics, step)  # after the checkpoint: a logged step is never trained twice
        self.progress.done(step)
        return step

    # ---- the pieces of a step ----

    def start_rollout(self, step: int) -> None:
        """Start step `step`'s rollout in the background. A checkpoint taken meanwhile saves the tasks' state as
        it was before this rollout drew its tasks or took carried groups, so a resumed run generates these
        episodes again."""
        before = self.tasks_state()
        self.ahead = (asyncio.create_task(self.rollout_groups(step)), before)

    def tasks_state(self) -> dict[str, Any]:
        """The task stream's state now, with the tasks of the groups carried over by over-sampling (started, not
        yet trained on): a resumed run draws those first."""
        return self.parts.tasks.state(self.stream.carried() if self.stream is not None else [])

    async def take_rollout(self, step: int) -> Rollout:
        """Step `step`'s rollout (started now in sync mode)."""
        if self.ahead is None:
            self.start_rollout(step)
        assert self.ahead is not None
        job, self.ahead = self.ahead[0], None
        return await job

    async def rollout_groups(self, step: int) -> Rollout:
        """The groups to train on, the groups that finished (for the step's rollout statistics) and metrics:
        with `rollout.over_sample_groups` the first groups with signal (`GroupStream`), else all of them."""
        started = time.perf_counter()
        cfg = self.cfg.rollout
        if self.stream is None:
            tasks = self.parts.tasks.next(cfg.prompts_per_step)  # drawn before the first await: see start_rollout
        await self.drills.during_rollout(step)
        if self.stream is None:
            groups = await self.parts.rollout(tasks, cfg.n_samples_per_prompt)
            used, finished, metrics = groups, groups, dict[str, float]()
        else:
            used, finished, metrics = await self.stream.collect()
        return used, finished, metrics | {"timing/rollout": time.perf_counter() - started}

    async def drop_ahead(self) -> None:
        """Cancel the rollouts still running (carried groups at the end of the run, or the run stopped)."""
        if self.ahead is not None:
            job, self.ahead = self.ahead[0], None
            job.cancel()
            with contextlib.suppress(BaseException):
                await job
        if self.stream is not None:
            await self.stream.close()

    def prepare(self, groups: list[EpisodeGroup], step: int, finished: list[EpisodeGroup]) -> Prepared | None:
        """The step's batch from `groups`; None when nothing is left to train on, or when most episodes that
        `finished` in the step's rollout were lost to the infrastructure (such a step says nothing about the
        policy; too many in a row stop the run)."""
        episodes = [e for g in finished for e in g.episodes]
        failed = sum(map(is_infra_failure, episodes))
        if episodes and failed / len(episodes) > self.cfg.rollout.max_infra_failure_rate:
            self.infra_failed_steps += 1
            log.warning("step %d: %d of %d episodes failed in the engines or the user simulator: "
                        "no update", step, failed, len(episodes))  # fmt: skip
            if self.infra_failed_steps >= self.cfg.rollout.max_infra_failed_steps:
                raise RunError(
                    f"{self.infra_failed_steps} steps in a row lost most episodes to engine or user-simulator "
                    f"failures (step {step}: {failed} of {len(episodes)}); see {self.run_dir / 'engines'} and "
                    "the user simulator's endpoint"
                )
            return None
        self.infra_failed_steps = 0
        if self.drills.skips_update(step):
            return None
        return prepare_batch(groups, self.cfg.algo)

    def on_policy(self) -> bool:
        """One optimizer step per RL step: the update starts from the weights that generated the rollout, so the
        training forward's own log-probs are the old ones (ratio 1) and no separate scoring pass is needed."""
        return self.cfg.algo.ppo_epochs == 1 and self.cfg.algo.mini_batches_per_step == 1

    def needs_scoring(self) -> bool:
        return not self.on_policy() or self.cfg.algo.kl_coef > 0

    async def score(self, batch: TrainBatch) -> None:
        """Old log-probs (recomputed by the trainer when the update is off-policy) and reference log-probs for KL."""
        if not self.on_policy():
            batch.old_logprobs = await asyncio.to_thread(self.parts.actors.compute_logprobs, batch, True)
        if self.cfg.algo.kl_coef > 0:
            batch.ref_logprobs = await asyncio.to_thread(self.parts.actors.compute_ref_logprobs, batch)

    async def update(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """`ppo_epochs` passes of `mini_batches_per_step` optimizer steps; metrics averaged over them."""
        algo, runs = self.cfg.algo, []
        for epoch in range(algo.ppo_epochs):
            for mini in mini_batches(batch, algo.mini_batches_per_step, seed=self.cfg.run.seed + 1000 * step + epoch):
                runs.append(await asyncio.to_thread(self.parts.actors.train_step, mini))
        return {k: sum(r[k] for r in runs if k in r) / sum(k in r for r in runs) for k in runs[0]} if runs else {}

    async def sync(self, version: int) -> dict[str, float]:
        """Pause the engines, push the trained weights bucket by bucket, flush their caches, resume."""
        return await self.parts.weights.push(version)

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        return bool(every) and step % every == 0

    def save(self, step: int, record: dict[str, float] | None = None) -> None:
        """Checkpoint the actor with the loop's state and the step's metrics (re-logged if the log missed them).
        With `checkpoint.async_save` the files are written while the run goes on (`CheckpointManager.commit`).
        A failed write leaves the previous checkpoint and `latest` as they were, and stops the run."""
        tasks = self.ahead[1] if self.ahead is not None else self.tasks_state()
        state = {"step": step, "tasks": tasks, "best": self.best, "record": record or {}}
        self.checkpoints.save(step, state, background=self.cfg.checkpoint.async_save)

    async def evaluate(self, step: int) -> dict[str, float]:
        """Episodes on the test tasks at the evaluation temperature; a new best score exports HF weights."""
        cfg = self.cfg.eval
        started = time.perf_counter()
        groups = await self.parts.rollout(self.parts.eval_tasks, cfg.n_samples_per_prompt, cfg.temperature)
        metrics = rollout_metrics([e for g in groups for e in g.episodes], prefix="eval/")
        write_step_evaluation(self.cfg, self.run.evaluation(step), step, groups, started)
        score = metrics.get("eval/reward_mean", float("-inf"))
        if score > self.best:
            self.best = score
            if step > 0:  # the initial policy is the model the run started from: nothing to export
                self.best_pending = (step, score)
        return metrics

    def export_best(self) -> None:
        """Export the weights of a new best evaluation as `hf/best`, in the training window after it (the actor is
        on the devices and its weights are still those evaluated), or at the end of the run."""
        if self.best_pending is not None:
            step, score = self.best_pending
            self.checkpoints.export_hf("best")
            self.run.best.write_text(json.dumps({"step": step, "eval/reward_mean": score}))
            self.best_pending = None

    def dump_rollouts(self, step: int, groups: list[EpisodeGroup]) -> None:
        """Write the step's rollout dump (`logging.rollout_dump_every`), before its checkpoint can be taken."""
        every = self.cfg.logging.rollout_dump_every
        if every and step % every == 0:
            episodes = [e for g in groups for e in g.episodes][: self.cfg.logging.rollout_dump_count]
            write_episodes(self.run.rollouts(step), episodes, step=step, replace=True)

    @staticmethod
    def step_record(groups: list[EpisodeGroup], metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` with the rollout statistics of the episodes that finished in the step."""
        episodes = [e for g in groups for e in g.episodes]
        weight_version = float(min((e.weight_version for e in episodes), default=0))
        return metrics | rollout_metrics(episodes) | {"train/weight_version": weight_version}

    def summarize(self, groups: list[EpisodeGroup], metrics: dict[str, float]) -> dict[str, float]:
        """The step's full metrics: its record and the services' counters."""
        return self.step_record(groups, metrics) | self.parts.service_metrics()

    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` names ("auto": the run's newest undamaged one); its step. An
        SFT checkpoint gives step 0 its weights, until the run has checkpoints of its own."""
        source = self.cfg.checkpoint.resume
        if source == "disable":
            return 0
        if source != "auto" and is_sft_checkpoint(source):
            if not self.checkpoints.history():
                return self.start_from(Path(source))
            source = "auto"  # the run has its own checkpoints since it started from the SFT weights
            log.info("checkpoint.resume names an SFT checkpoint, but the run has its own: resuming from those")
        path = self.checkpoints.locate(source)
        if path is None:
            return 0
        state = self.checkpoints.restore(path, self.cfg.checkpoint.load_optimizer)
        try:
            self.parts.tasks.restore(state["tasks"])
        except ValueError as e:  # another training mixture than the checkpoint's
            raise RunError(f"checkpoint {path}: {e}") from e
        self.best = state.get("best", float("-inf"))
        return int(state["step"])

    def start_from(self, path: Path) -> int:
        """Step 0 from the weights of an SFT checkpoint (`userrl sft`): its model only; the RL optimizer, schedule
        and task stream start fresh."""
        self.started_from = self.checkpoints.load_weights(path)
        self.tracker.rewind(0)  # an earlier attempt that saved no checkpoint: its steps run again
        log.info("starting RL from the weights of SFT checkpoint %s", self.started_from)
        return 0

    async def finish(self, step: int) -> None:
        """Save the final checkpoint (unless just saved) and export HF weights."""
        await self.parts.handoff.enter_training()  # colocated: the export gathers the actor's weights on the GPUs
        self.export_best()
        every = self.cfg.checkpoint.every_steps
        if step > 0 and not (every and step % every == 0):
            self.save(step)  # its metrics are already logged
        self.checkpoints.commit(wait=True)
        if self.cfg.checkpoint.save_hf and step > 0:
            self.checkpoints.export_hf(f"step_{step}")
        self.tracker.close()


def train(cfg: RootConfig) -> Path:
    """Run (or resume) the training run `cfg` describes; returns its run directory. One run per directory."""
    cfg = resolve_config(cfg)  # the config that runs is the one saved
    run = RunDir.of(cfg)
    run_dir = run.root

    async def main() -> None:
        async with start_components(cfg, run_dir) as parts:
            await Trainer(cfg, run_dir, parts).fit()

    with RunLock(run_dir):
        save_config(cfg, run.config)
        asyncio.run(main())
    return run_dir
