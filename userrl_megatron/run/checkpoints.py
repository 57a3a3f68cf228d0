"""CheckpointManager: a run's checkpoints, the same for `userrl train` and `userrl sft` (no Megatron import).

Saving goes through the actor group (every rank writes its shards; `checkpoint.async_save` writes them on a
thread, committed by `commit`). A failed save stops the run with one line: the root cause, the free space where
the checkpoint was written (writers often lose ENOSPC's message) and the newest checkpoint still intact; the
previous checkpoint and `latest` are left as they were.

Resuming (`checkpoint.resume`): "auto" loads the newest undamaged checkpoint of the run's history (what
`checkpoints/latest` names, then the older ones); a path loads the newest undamaged checkpoint under it (a folder
with a `latest` pointer) or that checkpoint itself. Each damaged checkpoint passed over is logged as an error
naming the one loaded instead. A named checkpoint that is damaged, or a history whose checkpoints are all damaged,
stops the run with an error naming the checkpoint and the damage. The steps logged after the loaded checkpoint are
forgotten (they run again) and a step interrupted between its checkpoint and its log line is logged again.
"""

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from userrl_megatron.config.schema import CheckpointConfig
from userrl_megatron.errors import RunError
from userrl_megatron.run.checkpoint_files import (
    EXTRA_FILE,
    META_FILE,
    CheckpointError,
    checkpoints_newest_first,
    find_damage,
    latest_target,
    newest_intact,
    read_metadata,
    resolve,
)
from userrl_megatron.run.run_dir import RunDir

log = logging.getLogger(__name__)


class Actors(Protocol):
    """What the manager calls on the actor group (`actors.workers.ActorGroup`); each runs on every rank."""

    def save(self, path: str, extra_state: dict[str, Any], ckpt: CheckpointConfig, background: bool) -> None: ...

    def finish_save(self, wait: bool) -> bool: ...

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]: ...

    def load_weights(self, path: str) -> None: ...

    def export_hf(self, out_dir: str) -> str | None: ...


class StepLog(Protocol):
    """What the manager needs of the run's metrics log (`observability.Tracker`)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def rewind(self, step: int) -> None: ...


class Stateful(Protocol):
    """A part of the trainer's small state the manager saves with each checkpoint under its name and restores on
    resume (as torchtitan's checkpointer does its `Stateful`s): the task stream, the best score."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class CheckpointManager:
    """Save, commit, resume and export the checkpoints of the run in `run`; owns the save interval
    (`checkpoint.every_steps`) and the trainer's `Stateful`s."""

    def __init__(self, run: RunDir, cfg: CheckpointConfig, actors: Actors, steps: StepLog) -> None:
        self.run, self.cfg, self.actors, self.steps = run, cfg, actors, steps
        self.saving: Path | None = None  # a checkpoint being written in the background
        self.states: dict[str, Stateful] = {}  # saved and restored under their names (`register`)

    def register(self, name: str, state: Stateful) -> None:
        """Save `state` with every `save_step` under `name`; restore it from there on resume."""
        self.states[name] = state

    def due(self, step: int) -> bool:
        """Whether step `step` is checkpointed (`checkpoint.every_steps`; 0: only at the end)."""
        every = self.cfg.every_steps
        return bool(every) and step % every == 0

    # ---- saving ----

    def save_step(self, step: int, record: dict[str, float] | None = None) -> Path:
        """Checkpoint the trainer at `step`: the actor, every registered state, and the step's `record` (its
        metrics so far, logged on resume if the log missed them); in the background with `checkpoint.async_save`
        (`commit` finishes it)."""
        state = {"step": step} | {name: s.state_dict() for name, s in self.states.items()} | {"record": record or {}}
        return self.save(step, state, background=self.cfg.async_save)

    def save(self, step: int, state: dict[str, Any], background: bool = False) -> Path:
        """Checkpoint the actor as `checkpoints/step_<step>` with the trainer's `state` (its extra state). In the
        `background` the files are written while the run goes on: `commit` finishes them. A failed write stops
        the run (RunError), the previous checkpoint and `latest` as they were."""
        path = self.run.checkpoint(step)
        with self._failure(path):
            self.actors.save(str(path), state, self.cfg, background)
        self.saving = path if background else None
        return path

    def commit(self, wait: bool) -> None:
        """Commit the background save once every rank has written its files (`wait`: block until then)."""
        if self.saving is not None:
            with self._failure(self.saving):
                if self.actors.finish_save(wait):
                    self.saving = None

    @contextlib.contextmanager
    def _failure(self, path: Path) -> Iterator[None]:
        """Turn a failed save of `path` into the RunError that diagnoses it; the steps logged after the newest
        intact checkpoint are forgotten (a resume runs them again)."""
        try:
            yield
        except Exception as e:
            self.saving = None
            try:
                history = checkpoints_newest_first(path.parent)
            except CheckpointError:
                history = []  # the save's own failure is what to report
            kept = _first_intact(history)
            self.steps.rewind(int(_extra_state(kept).get("step", 0)) if kept else 0)
            intact = f"{kept} is intact" if kept else "no earlier checkpoint exists"
            cause, free = root_cause(e), free_mib(path.parent)
            raise RunError(f"saving checkpoint {path} failed ({cause}; {free:.1f} MiB free there); {intact}") from e

    def export_hf(self, name: str) -> Path:
        """Write the actor's weights as an HF directory `hf/<name>`."""
        out = self.run.hf(name)
        self.actors.export_hf(str(out))
        return out

    # ---- resuming ----

    def history(self) -> list[Path]:
        """The run's own checkpoints, newest first (damaged ones included); a `latest` pointer outside
        `checkpoints/` stops the run."""
        try:
            return checkpoints_newest_first(self.run.checkpoints)
        except CheckpointError as e:
            raise RunError(str(e)) from e

    def locate(self, source: str) -> Path | None:
        """The checkpoint `source` ("auto" or a path; see the module) resumes from; each damaged one passed over
        is logged. None: nothing to resume ("auto" in a run without checkpoints)."""
        if source == "auto":
            candidates = self.history()
        else:
            named = Path(source)
            try:
                candidates = checkpoints_newest_first(named)
            except CheckpointError as e:
                raise RunError(f"checkpoint.resume = {source}: {e}") from e
            if not candidates:
                if not (named / META_FILE).is_file():
                    raise RunError(f"checkpoint.resume = {source}: no checkpoint there")
                damage = find_damage(named)
                if damage is not None:
                    raise RunError(f"checkpoint.resume = {source}: the checkpoint is damaged ({damage})")
                return named
        try:
            return newest_intact(candidates)
        except CheckpointError as e:
            raise RunError(str(e) if source == "auto" else f"checkpoint.resume = {source}: {e}") from e

    def restore(self, path: Path, with_optimizer: bool = True) -> dict[str, Any]:
        """Load the checkpoint `path` (model, optimizer, schedule, RNG) on every rank, and the registered states
        it holds; its extra state. The steps logged after it are forgotten; its own step's record is logged again
        when the log missed it."""
        state = self.actors.load(str(path), with_optimizer)
        step = int(state["step"])
        self.steps.rewind(step)  # steps after an older checkpoint run again: their old lines go
        if state.get("record") and step not in self.run.logged_steps():
            self.steps.log(state["record"], step)  # interrupted between its checkpoint and its log line
        for name, stateful in self.states.items():
            if name in state:
                try:
                    stateful.load_state_dict(state[name])
                except ValueError as e:  # e.g. another training mixture than the checkpoint's
                    raise RunError(f"checkpoint {path}: {e}") from e
        log.info("resumed from %s at step %d", path, step)
        return state

    def load_weights(self, path: str | Path) -> Path:
        """Load only the model weights of the checkpoint `path` names (the optimizer, schedule and step stay
        fresh); the checkpoint loaded. A damaged one stops the run."""
        try:
            resolved = resolve(path)
        except CheckpointError as e:
            raise RunError(f"checkpoint.resume = {path}: {e}") from e
        damage = find_damage(resolved)
        if damage is not None:
            raise RunError(f"checkpoint.resume = {path}: checkpoint {resolved} is damaged ({damage})")
        self.actors.load_weights(str(resolved))
        return resolved

    @staticmethod
    def extra_state(path: str | Path) -> dict[str, Any]:
        """The extra state of a checkpoint (or of the one a `latest` pointer names); {} if it has none."""
        return _extra_state(resolve(path))

    @staticmethod
    def check_data(path: Path, state: dict[str, Any], expected: dict[str, Any], remedy: str) -> None:
        """Stop the run unless the checkpoint's extra `state` holds the `expected` values (the data fingerprint
        and schedule a resume must continue); `remedy` says which settings decide them and what to do."""
        differ = sorted(k for k, v in expected.items() if state.get(k) != v)
        if differ:
            raise RunError(
                f"checkpoint {path} was trained on other data or another schedule ({', '.join(differ)} differ: "
                f"{remedy})"
            )

    # ---- before anything starts (no actor: `trainer/preflight.py`) ----

    @staticmethod
    def is_sft(path: str | Path) -> bool:
        """Whether `path` (a checkpoint, or a folder with a `latest` pointer) was written by `userrl sft`."""
        try:
            return CheckpointManager.extra_state(path).get("kind") == "sft"
        except (CheckpointError, OSError, ValueError, AttributeError):
            return False

    @staticmethod
    def finished_step(run: RunDir, cfg: CheckpointConfig, total_steps: int) -> int | None:
        """The step of the run's latest checkpoint when it is at (or past) `total_steps`, logged, and its HF
        export written (with `cfg.save_hf`); None when there is training (or exporting) left to do."""
        if cfg.resume != "auto" and not CheckpointManager.is_sft(cfg.resume):
            return None  # an SFT checkpoint is only the starting point: the run's own checkpoints say where it is
        try:
            head = latest_target(run.checkpoints)
            step = int(_extra_state(head)["step"]) if head is not None else None
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            return None  # no (readable) checkpoint: the driver decides what to do
        if step is None or step < total_steps:
            return None
        if cfg.save_hf and not run.exported(step):
            return None
        if step not in run.logged_steps():
            return None  # killed between the checkpoint and its log line: the driver re-logs it
        return step

    @staticmethod
    def start_problems(run: RunDir, source: str, padded_vocab: int | None, tp: int) -> list[str]:
        """What would stop the run after start-up: the run's `latest` pointer (every save moves it, whatever the
        run resumes from) or `source`'s pointing elsewhere, and a checkpoint to resume whose vocabulary is padded
        to other than `padded_vocab` rows (what the model pads to at TP `tp`; None: unknown)."""
        try:
            latest_target(run.checkpoints)
        except CheckpointError as e:
            return [str(e)]
        except OSError:
            pass
        if source == "disable":
            return []
        path = run.checkpoints if source == "auto" else Path(source)
        try:
            latest_target(path)
        except CheckpointError as e:
            return [str(e)]  # a pointer outside the run directory
        except OSError:
            pass
        try:
            meta = read_metadata(path)
        except (CheckpointError, OSError, ValueError):
            return []  # nothing to resume, or a damaged checkpoint: the driver reports it
        if padded_vocab is None or "padded_vocab_size" not in meta or padded_vocab == meta["padded_vocab_size"]:
            return []
        return [
            f"megatron.tensor_model_parallel_size = {tp} pads the vocabulary to {padded_vocab} rows, but the "
            f"checkpoint the run resumes from ({path}) was saved with {meta['padded_vocab_size']} rows "
            f"(TP = {meta['layout']['tp']}): use a TP that pads it the same way, or set checkpoint.resume"
        ]


def _first_intact(candidates: list[Path]) -> Path | None:
    """The first undamaged of `candidates` (newest first); each damaged one passed over is logged."""
    for path in candidates:
        damage = find_damage(path)
        if damage is None:
            return path
        log.error("checkpoint %s is damaged (%s): passed over", path, damage)
    return None


def _extra_state(path: Path) -> dict[str, Any]:
    file = path / EXTRA_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def free_mib(path: Path) -> float:
    """The free space of the filesystem holding `path` (or its nearest existing parent), in MiB."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return shutil.disk_usage(path).free / 2**20


def root_cause(error: BaseException) -> str:
    """The innermost error's type and first line (a Ray task error wraps the rank's own)."""
    while isinstance(inner := getattr(error, "cause", None) or error.__cause__, BaseException) and inner is not error:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
