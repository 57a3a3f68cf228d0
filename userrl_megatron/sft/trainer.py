"""`userrl sft`: supervised fine-tuning of the Megatron actor on multi-turn conversations.

The same actor ranks as RL (Ray workers, any TP/PP/DP/CP layout), the loss `sft_nll`: the token NLL of the
assistant tokens, divided by the number of assistant tokens of the whole optimizer step (all micro-batches and
data-parallel ranks). Samples are tokenised by the rollout chat code (`sft/tokens.py`); each step packs whole
conversations up to `sft.batch_tokens` (`sft/batches.py`). The LR schedule is the actor's own (Megatron's
scheduler): linear warm-up over `sft.warmup_ratio` of the steps, then `sft.lr_schedule` down to `sft.min_lr` at
the end of the run. Checkpoints have the RL format and `latest` pointer; their extra state says `"kind": "sft"`, so
`userrl train checkpoint.resume=<sft checkpoint>` starts RL from its weights (step 0, fresh optimizer), and
relaunching `userrl sft` resumes at the step after the newest checkpoint, on the same samples.
"""

import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from userrl_megatron.actors.protocol import Actors
from userrl_megatron.actors.run_lock import RunLock
from userrl_megatron.config import AlgoConfig, RootConfig, save_config
from userrl_megatron.errors import UserError
from userrl_megatron.observability import Timers, Tracker
from userrl_megatron.observability.progress import StepProgress
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.run.run_dir import RunDir
from userrl_megatron.sft.batches import fingerprint, schedule, train_batch
from userrl_megatron.sft.experts import EXPERT_PREFIX, expert_rows
from userrl_megatron.sft.rows import Rejection, RowError, read_rows
from userrl_megatron.sft.tokens import Sample, tokenize_row

log = logging.getLogger(__name__)

SFT_ALGO = AlgoConfig(policy_loss="sft_nll", loss_agg="token-mean", kl_coef=0.0, entropy_coef=0.0)
CONSOLE_KEYS = ("sft/nll", "val/loss", "actor/grad_norm", "actor/lr", "sft/epoch", "actor/tokens_per_s")
KIND = "sft"  # extra_state["kind"] of an SFT checkpoint
SHOWN_REJECTIONS = 10  # rejections printed to the console; all of them go to rejected_rows.jsonl


@dataclass
class Dataset:
    """Tokenised samples of one split and the rows left out."""

    samples: list[Sample] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    @property
    def trained_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.samples)


def token_limit(cfg: RootConfig) -> tuple[int, str]:
    """The longest sample that can be trained on, and the option that sets it."""
    limits = [
        (
            cfg.sft.max_tokens or cfg.model.max_context_length,
            "sft.max_tokens" if cfg.sft.max_tokens else "model.max_context_length",
        ),
        (cfg.sft.batch_tokens, "sft.batch_tokens"),
        (cfg.megatron.micro_batch_tokens, "megatron.micro_batch_tokens"),
    ]
    return min(limits)


def load_dataset(cfg: RootConfig, chat: ChatTemplate, entries: list[str], split: str) -> Dataset:
    """Read, check and tokenise every entry of `sft.train_files` / `sft.val_files` (`split`: the expert's split)."""
    data = Dataset()
    limit, option = token_limit(cfg)
    for entry in entries:
        if entry.startswith(EXPERT_PREFIX):
            source = entry.removeprefix(EXPERT_PREFIX)
            try:
                rows = expert_rows(source, split, cfg.gyms, cfg.rollout, chat, cfg.sft.expert_tasks)
            except ValueError as e:
                raise UserError(f"sft data {entry}: {e}") from e
            rejected: list[Rejection] = []
        else:
            rows, rejected = read_rows(Path(entry).expanduser())
        data.rejected += rejected
        for row in rows:
            try:
                sample = tokenize_row(chat, row, limit)
            except RowError as e:
                reason = str(e) + (f" ({option})" if "more than the limit" in str(e) else "")
                data.rejected.append(Rejection(row.source, reason))
                continue
            data.samples.append(sample)
    return data


def report_rejections(data: Dataset, name: str, run_dir: Path) -> None:
    """Print and log how many rows were rejected, the first few reasons, and write all of them to a file."""
    if not data.rejected:
        return
    path = run_dir / f"rejected_{name}_rows.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in data.rejected:
            f.write(json.dumps({"row": r.source, "reason": r.reason}, ensure_ascii=False) + "\n")
    log.warning("sft %s data: %d row(s) rejected (all reasons in %s)", name, len(data.rejected), path)
    for r in data.rejected[:SHOWN_REJECTIONS]:
        log.warning("  rejected %s", r)
    if len(data.rejected) > SHOWN_REJECTIONS:
        log.warning("  ... and %d more", len(data.rejected) - SHOWN_REJECTIONS)


def sft_megatron(cfg: RootConfig, total_steps: int) -> Any:
    """The actor's optimizer settings for SFT: `sft.lr`, warm-up over `sft.warmup_ratio` of the steps, then decay
    towards `sft.min_lr`, reached one step after the last (the last step still learns), `sft.grad_clip`."""
    warmup = round(cfg.sft.warmup_ratio * total_steps)
    return replace(
        cfg.megatron,
        lr=cfg.sft.lr,
        min_lr=cfg.sft.min_lr,
        lr_schedule=cfg.sft.lr_schedule,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps + 1, warmup + 1),  # min_lr one step after the last: no step at min_lr
        grad_clip=cfg.sft.grad_clip,
    )


class SFTTrainer:
    """The SFT loop over the actor ranks of `actors`."""

    def __init__(self, cfg: RootConfig, run_dir: Path, actors: Actors, train: Dataset, val: Dataset) -> None:
        self.cfg, self.run_dir, self.actors = cfg, run_dir, actors
        self.train, self.val = train, val
        lengths = [len(s) for s in train.samples]
        self.plan = schedule(lengths, cfg.sft.batch_tokens, cfg.run.seed, cfg.sft.epochs)
        self.steps_per_epoch = [sum(1 for e, _ in self.plan if e == k) for k in range(cfg.sft.epochs)]
        self.fingerprint = fingerprint([(s.token_ids, s.loss_mask) for s in train.samples])
        self.tracker = Tracker(cfg.logging, run_dir, cfg.run.name, asdict(cfg), console_keys=CONSOLE_KEYS)
        self.run = RunDir(run_dir)
        self.checkpoints = CheckpointManager(self.run, cfg.checkpoint, actors, self.tracker)
        self.progress = StepProgress(len(self.plan))

    @property
    def total_steps(self) -> int:
        return len(self.plan)

    def fit(self, stop_after: int | None = None) -> int:
        """Train to the last step (or stop after step `stop_after`, as an interruption would); returns the step."""
        cfg = self.cfg.sft
        step = self.resume()
        if step == 0:
            self.tracker.rewind(-1)  # an earlier attempt without a checkpoint: its lines go, its steps run again
        if step == self.total_steps and self.exported(step):
            log.info("%s already finished at step %d: nothing to train", self.run_dir, step)
            self.tracker.close()
            return step
        last = self.total_steps if stop_after is None else min(stop_after, self.total_steps)
        if step == 0:  # the data, and the initial model's validation loss
            start = {"data/train_samples": float(len(self.train.samples)), "data/total_steps": float(self.total_steps)}
            start |= {"data/rejected_rows": float(len(self.train.rejected))}
            start |= {"data/val_rejected_rows": float(len(self.val.rejected))}
            if self.val.samples:
                start |= self.validate()
            self.tracker.log(start, 0)
        saved = step
        while step < last:
            step += 1
            timers = Timers()
            with timers("step"):
                epoch, indices = self.plan[step - 1]
                samples = [self.train.samples[i] for i in indices]
                batch = train_batch([s.token_ids for s in samples], [s.loss_mask for s in samples])
                metrics = self.actors.train_step(batch)
                done_in_epoch = step - sum(self.steps_per_epoch[:epoch])
                metrics["sft/epoch"] = epoch + done_in_epoch / self.steps_per_epoch[epoch]
                metrics["sft/samples"] = float(len(samples))
                if cfg.val_every_steps and step % cfg.val_every_steps == 0 and self.val.samples:
                    with timers("val"):
                        metrics |= self.validate()
            metrics |= timers.pop()
            if cfg.save_every_steps and step % cfg.save_every_steps == 0:
                self.save(step, metrics)
                saved = step
            self.tracker.log(metrics, step)
            self.progress.done(step)
        if step == self.total_steps and step > 0:
            self.finish(step, saved, validated=bool(cfg.val_every_steps) and step % cfg.val_every_steps == 0)
        self.tracker.close()
        return step

    def exported(self, step: int) -> bool:
        """The run's final HF export is written (or none is wanted)."""
        return not self.cfg.checkpoint.save_hf or self.run.exported(step)

    def validate(self) -> dict[str, float]:
        """Token NLL of the validation samples' assistant tokens under the current weights (no update)."""
        nll = tokens = 0.0
        for _, indices in schedule([len(s) for s in self.val.samples], self.cfg.sft.batch_tokens, 0, 1):
            samples = [self.val.samples[i] for i in indices]
            batch = train_batch([s.token_ids for s in samples], [s.loss_mask for s in samples])
            logprobs = self.actors.compute_logprobs(batch, True)  # the assistant tokens only
            for lp, mask in zip(logprobs, batch.loss_mask, strict=True):
                nll -= sum(v for v, m in zip(lp, mask, strict=True) if m)
                tokens += sum(mask)
        return {"val/loss": nll / max(tokens, 1.0), "val/tokens": tokens}

    def save(self, step: int, record: dict[str, float] | None = None) -> None:
        """A checkpoint of the actor (RL's format) with the SFT position, written before the next step; a failed
        write stops the run."""
        state = {
            "kind": KIND,
            "step": step,
            "total_steps": self.total_steps,
            "data": self.fingerprint,
            "record": record or {},
        }
        self.checkpoints.save(step, state)

    def finish(self, step: int, saved: int, validated: bool) -> None:
        """After the last step: the validation loss (unless just measured), the checkpoint, the HF export."""
        if self.val.samples and not validated:
            self.tracker.log(self.validate(), step)
        if saved != step:
            self.save(step)
        if self.cfg.checkpoint.save_hf:
            log.info("HF export: %s", self.checkpoints.export_hf(f"step_{step}"))

    def resume(self) -> int:
        """The step to continue after: the run's newest intact checkpoint (`checkpoint.resume: auto`), a named SFT
        checkpoint, or 0. A named non-SFT checkpoint (an RL run's, a converted one) gives only its weights."""
        source = self.cfg.checkpoint.resume
        if source == "disable":
            return 0
        path = self.checkpoints.locate(source)
        if path is None:
            return 0
        extra = self.checkpoints.extra_state(path)
        if extra.get("kind") != KIND:
            self.checkpoints.load_weights(path)
            log.info("starting SFT from the weights of %s", path)
            return 0
        expected = {"data": self.fingerprint, "total_steps": self.total_steps}
        remedy = "sft files, epochs, batch_tokens, run.seed: use a new run.name, or checkpoint.resume=disable to "
        remedy += "start over"
        self.checkpoints.check_data(path, extra, expected, remedy)
        return int(self.checkpoints.restore(path)["step"])


def run_sft(cfg: RootConfig, stop_after: int | None = None) -> Path:
    """Run (or resume) the SFT run `cfg` describes; returns its run directory."""
    from userrl_megatron.actors.workers import ActorGroup, WorkerSpec, thread_env
    from userrl_megatron.fleet.gpu_preflight import check_gpu_run
    from userrl_megatron.fleet.placement import plan_bundles, reserve_placement
    from userrl_megatron.model_store import resolve_model

    run = RunDir.of(cfg)
    run_dir = run.root
    with RunLock(run_dir):
        save_config(cfg, run.config)
        started = time.perf_counter()
        chat = ChatTemplate.from_pretrained(resolve_model(cfg.model.path), cfg.model.tool_format)
        train = load_dataset(cfg, chat, cfg.sft.train_files, "train")
        val = load_dataset(cfg, chat, cfg.sft.val_files, "test")
        if cfg.sft.val_max_rows:
            val.samples = val.samples[: cfg.sft.val_max_rows]
        for name, data in (("train", train), ("val", val)):
            report_rejections(data, name, run_dir)
        if not train.samples:
            raise UserError(
                f"sft.train_files {cfg.sft.train_files}: no row left to train on ({len(train.rejected)} rejected)"
            )
        log.info(
            "sft data: %d train samples (%d tokens, %d trained), %d val samples; %d + %d rows rejected (%.1f s)",
            len(train.samples),
            train.tokens,
            train.trained_tokens,
            len(val.samples),
            len(train.rejected),
            len(val.rejected),
            time.perf_counter() - started,
        )
        total = len(schedule([len(s) for s in train.samples], cfg.sft.batch_tokens, cfg.run.seed, cfg.sft.epochs))
        actors_only = replace(cfg.rollout, num_engines=0, colocate=False)

        def check(on_gpu: bool) -> None:
            if on_gpu:
                check_gpu_run(cfg, engines=False)  # the trainer's torch and the driver (fleet/gpu_preflight.py)

        plan = partial(plan_bundles, cfg.megatron, actors_only)
        with reserve_placement(cfg.run, plan, len(plan(False).bundles), check) as placement:
            spec = WorkerSpec(cfg.model, sft_megatron(cfg, total), SFT_ALGO, cfg.sync, cfg.run.seed)
            actors = ActorGroup(placement, spec, thread_env(placement))
            try:
                SFTTrainer(cfg, run_dir, actors, train, val).fit(stop_after)
            finally:
                actors.shutdown()
    return run_dir
