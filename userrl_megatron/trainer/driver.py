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
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

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
from userrl_megatron.trainer.rollout_strategy import rollout_strategy
from userrl_megatron.types import EpisodeGroup, TrainBatch

log = logging.getLogger(__name__)
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


class BestModel:
    """The best evaluation score so far (checkpointed as "best") and its HF export, deferred to the next training
    window (the actor is on the devices and its weights are still those evaluated) or the end of the run."""

    def __init__(self, run: RunDir, checkpoints: CheckpointManager) -> None:
        self.run, self.checkpoints = run, checkpoints
        self.score = float("-inf")
        self.pending: tuple[int, float] | None = None  # (step, score) of a best evaluation not exported yet

    def offer(self, step: int, score: float) -> None:
        """A new best score is exported later; the initial policy's (step 0) is the model the run started from."""
        if score > self.score:
            self.score = score
            if step > 0:
                self.pending = (step, score)

    def export(self) -> None:
        """Write the pending best weights as `hf/best` (and `best.json`)."""
        if self.pending is not None:
            step, score = self.pending
            self.checkpoints.export_hf("best")
            self.run.best.write_text(json.dumps({"step": step, "eval/reward_mean": score}))
            self.pending = None

    def state_dict(self) -> float:
        return self.score

    def load_state_dict(self, state: float) -> None:
        self.score = state


class Trainer:
    """Owns the run's components; `fit()` is the RL loop."""

    def __init__(self, cfg: RootConfig, run_dir: Path, parts: Components, drills: Drills | None = None) -> None:
        self.cfg, self.run_dir, self.parts = cfg, run_dir, parts
        # fault drills: a test's, else `USERRL_DRILLS`'s (none in a normal run)
        self.drills = drills if drills is not None else Drills.from_env(parts.pool, parts.sim_pool)
        self.run = RunDir(run_dir)
        self.tracker = Tracker(cfg.logging, run_dir, cfg.run.name, asdict(cfg), console_keys=SUMMARY_KEYS)
        self.checkpoints = CheckpointManager(self.run, cfg.checkpoint, parts.actors, self.tracker)
        self.rollouts = rollout_strategy(cfg, parts, self.drills, lambda g: trainable_part(g, cfg.algo).has_signal)
        self.best = BestModel(self.run, self.checkpoints)
        self.checkpoints.register("tasks", self.rollouts)  # the task stream as of before the rollouts in flight
        self.checkpoints.register("best", self.best)
        self.progress = StepProgress(cfg.run.total_steps)  # `step N/total  elapsed  ETA` after each step
        self.infra_failed_steps = 0  # steps in a row lost mostly to the infrastructure
        self.started_from: Path | None = None  # the SFT checkpoint whose weights step 0 started from
        self.version = 0  # weight version of the trainer's policy (the step of its last update)

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
            await self.rollouts.close()
        await self.finish(step)
        return step

    async def run_step(self, step: int) -> int:
        """One RL step: rollout, filters, training window (with a due checkpoint), weight push, evaluation, log.
        `self.rollouts` decides when rollouts run (`trainer/rollout_strategy.py`: in one_step_off, step + 1's
        runs while this step trains); in sync mode its hooks do nothing."""
        timers = Timers()
        with timers("step"):
            with timers("rollout_wait"):
                groups, finished, metrics = await self.rollouts.take(step)
            self.dump_rollouts(step, finished)
            await self.drills.after_rollout(step)
            self.rollouts.begin_next(step)
            fresh, stale = bound_staleness(groups, self.version, self.staleness_bound())
            metrics |= stale
            prepared = self.prepare(fresh, step, finished)
            if prepared is not None:
                metrics |= await self.train(step, prepared, finished, metrics, timers)
            with timers("rollout_wait"):
                await self.rollouts.before_push()  # one_step_off: the engines finish step + 1's episodes first
            if prepared is not None:
                metrics |= await self.push(step, timers)
            if self.cfg.eval.every_steps and step % self.cfg.eval.every_steps == 0:
                with timers("eval"):
                    metrics |= await self.evaluate(step)
        metrics = self.summarize(finished, metrics | timers.pop())
        if prepared is None and self.checkpoints.due(step):  # no training window this step
            with timers("checkpoint"):
                async with self.parts.handoff.actor_on_device():
                    self.checkpoints.save_step(step, metrics)
            metrics |= timers.pop()
        self.checkpoints.commit(wait=False)
        self.drills.before_log(step, self.checkpoints)
        self.tracker.log(metrics, step)  # after the checkpoint: a logged step is never trained twice
        self.progress.done(step)
        return step

    # ---- the pieces of a step ----

    def staleness_bound(self) -> int | None:
        """How many versions a group may lag the trainer (`rollout.max_staleness`); without sync the engines keep
        version 0, so no bound."""
        return self.cfg.rollout.max_staleness if self.cfg.sync.enabled else None

    async def train(
        self, step: int, prepared: Prepared, finished: list[EpisodeGroup], metrics: dict[str, float], timers: Timers
    ) -> dict[str, float]:
        """The training window: the actor takes the devices, a pending best export runs (the weights the last
        evaluation scored, before this update changes them), log-probs, the update. A due checkpoint is taken
        here, before the engines get the new weights, with the step's record so far (`metrics`, the update's and
        the timings: what a resume logs if the step's log line is missing)."""
        await self.parts.handoff.enter_training()
        self.best.export()
        if self.needs_scoring():
            with timers("logprobs"):
                await self.score(prepared.batch)
        with timers("train"):
            out = await self.update(prepared.batch, step)
        self.version = step
        out |= prepared.metrics  # the actor reports the rollout/trainer mismatch/*
        if self.checkpoints.due(step):
            with timers("checkpoint"):
                self.checkpoints.save_step(step, self.step_record(finished, metrics | out | timers.read()))
        return out

    async def push(self, step: int, timers: Timers) -> dict[str, float]:
        """After an update: the new weights go to the engines (`sync.enabled`), which take the devices back."""
        out = dict[str, float]()
        if self.cfg.sync.enabled:
            with timers("sync"):
                out = await self.sync(step)
        await self.parts.handoff.enter_rollout()
        return out

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

    async def evaluate(self, step: int) -> dict[str, float]:
        """Episodes on the test tasks at the evaluation temperature; a new best score exports HF weights."""
        cfg = self.cfg.eval
        started = time.perf_counter()
        groups = await self.parts.rollout(self.parts.eval_tasks, cfg.n_samples_per_prompt, cfg.temperature)
        metrics = rollout_metrics([e for g in groups for e in g.episodes], prefix="eval/")
        write_step_evaluation(self.cfg, self.run.evaluation(step), step, groups, started)
        self.best.offer(step, metrics.get("eval/reward_mean", float("-inf")))
        return metrics

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
        if source != "auto" and self.checkpoints.is_sft(source):
            if not self.checkpoints.history():
                return self.start_from(Path(source))
            source = "auto"  # the run has its own checkpoints since it started from the SFT weights
            log.info("checkpoint.resume names an SFT checkpoint, but the run has its own: resuming from those")
        path = self.checkpoints.locate(source)
        if path is None:
            return 0
        state = self.checkpoints.restore(path, self.cfg.checkpoint.load_optimizer)  # the task stream, the best
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
        self.best.export()
        if step > 0 and not self.checkpoints.due(step):
            self.checkpoints.save_step(step)  # its metrics are already logged
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
