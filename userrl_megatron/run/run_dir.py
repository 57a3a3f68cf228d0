"""The layout of a run directory, `<run.output_dir>/<run.name>`, the same for `userrl train` and `userrl sft`.

config.yaml           the resolved configuration of the last launch
metrics.jsonl         one line per logged step (`observability.Tracker`)
checkpoints/step_N    the run's checkpoints; `checkpoints/latest` names the newest of its history
hf/step_N, hf/best    Hugging Face exports: the final weights, the best evaluation's (RL)
eval/step_N, rollouts/step_N.jsonl, best.json, engines/   RL only: evaluations, rollout dumps, engine logs
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from userrl_megatron.observability import read_metrics


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    @classmethod
    def of(cls, cfg: Any) -> "RunDir":
        """The run directory a RootConfig names: `<run.output_dir>/<run.name>`."""
        return cls(Path(cfg.run.output_dir) / cfg.run.name)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def best(self) -> Path:
        return self.root / "best.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def hf(self, name: str) -> Path:
        """An HF export: `hf/step_N` (the final weights) or `hf/best`."""
        return self.root / "hf" / name

    def evaluation(self, step: int) -> Path:
        return self.root / "eval" / f"step_{step}"

    def rollouts(self, step: int) -> Path:
        return self.root / "rollouts" / f"step_{step}.jsonl"

    def exported(self, step: int) -> bool:
        """Whether the HF export of step `step` is written."""
        return (self.hf(f"step_{step}") / "config.json").is_file()

    def logged_steps(self) -> set[int]:
        """The steps `metrics.jsonl` holds."""
        return {r["step"] for r in read_metrics(self.metrics)} if self.metrics.is_file() else set()
