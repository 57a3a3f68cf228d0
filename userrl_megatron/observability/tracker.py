"""Metric tracker: one `log(metrics, step)` fanned out to the console, metrics.jsonl, wandb and TensorBoard.

metrics.jsonl in the run directory is always written; it is the record `userrl` itself reads back (resume,
summaries, tests). wandb runs offline unless configured otherwise and never needs a key to do so.
"""

import json
import math
import time
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from rich.console import Console

from userrl_megatron.config.schema import LoggingConfig

Metrics = dict[str, float]
WandbMode = Literal["online", "offline", "disabled"]  # logging.wandb_mode (its values are checked in config.checks)


class Backend(Protocol):
    def log(self, metrics: Metrics, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlBackend:
    """Appends one JSON object per step: {"step": N, "time": unix seconds, **metrics}."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)

    def log(self, metrics: Metrics, step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def rewind(self, step: int) -> None:
        """Drop the records of steps after `step` (a run resumed from an older checkpoint does them again)."""
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
        self._file = self.path.open("a", buffering=1)

    def close(self) -> None:
        self._file.close()


class ConsoleBackend:
    """One line per step: the metrics named in `keys` (in that order), or every metric when `keys` is empty."""

    def __init__(self, console: Console | None = None, keys: tuple[str, ...] = ()) -> None:
        self.console = console or Console(highlight=False)
        self.keys = keys

    def log(self, metrics: Metrics, step: int) -> None:
        shown = [(k, metrics[k]) for k in self.keys if k in metrics] if self.keys else sorted(metrics.items())
        parts = [f"[bold]step {step}[/bold]"] + [f"{k}={_short(v)}" for k, v in shown]
        self.console.print("  ".join(parts), soft_wrap=True)

    def close(self) -> None:
        pass


class WandbBackend:
    """wandb in the configured mode (offline by default); files go under the run directory."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_name: str, config: dict[str, Any] | None) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.wandb_entity or None,
            name=run_name,
            mode=cast(WandbMode, cfg.wandb_mode),
            dir=str(run_dir),
            config=config or {},
            resume="allow",
            id=_wandb_run_id(run_dir),
        )

    def log(self, metrics: Metrics, step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardBackend:
    """Scalars into `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: Metrics, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Tracker:
    """Fans metrics out to every configured backend; metrics.jsonl is always on."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        run_name: str = "run",
        config: dict[str, Any] | None = None,
        console: Console | None = None,
        console_keys: tuple[str, ...] = (),
    ) -> None:
        run_dir = Path(run_dir)
        self.jsonl = JsonlBackend(run_dir / "metrics.jsonl")
        self.backends: list[Backend] = [self.jsonl]
        for name in cfg.backends:
            if name == "console":
                self.backends.append(ConsoleBackend(console, console_keys))
            elif name == "wandb":
                self.backends.append(WandbBackend(cfg, run_dir, run_name, config))
            elif name == "tensorboard":
                self.backends.append(TensorBoardBackend(run_dir))
            elif name != "jsonl":
                raise ValueError(f"unknown logging backend {name!r}")

    def log(self, metrics: Metrics, step: int) -> None:
        """Record `metrics` for `step` in every backend."""
        clean = {k: float(v) for k, v in metrics.items()}
        for backend in self.backends:
            backend.log(clean, step)

    def rewind(self, step: int) -> None:
        """Forget the steps after `step` in metrics.jsonl (other backends keep what they were sent)."""
        self.jsonl.rewind(step)

    def close(self) -> None:
        """Flush and close every backend."""
        for backend in self.backends:
            backend.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _wandb_run_id(run_dir: Path) -> str:
    """A stable wandb id per run directory, so a resumed run continues the same wandb run."""
    id_file = run_dir / "wandb_run_id"
    if not id_file.exists():
        import uuid

        run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(uuid.uuid4().hex[:12])
    return id_file.read_text().strip()


def _jsonable(v: float) -> float | str:
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _short(v: float) -> str:
    if float(v).is_integer() and abs(v) < 1e12:
        return str(int(v))
    return f"{v:.4g}"
