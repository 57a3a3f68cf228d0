"""What the end-to-end tests share: a `userrl train` run of a tiny policy on EchoGym, on CPU, small budgets."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from userrl_megatron.observability import read_metrics
from userrl_megatron.trainer.drills import DRILLS_ENV

REPO = Path(__file__).resolve().parents[2]
# A bound on a `userrl train` that never ends (a hang), many times what the slowest of these runs takes on a
# busy machine: no run that works comes near it.
RUN_TIMEOUT_S = 3600.0


def tiny_run(model: Path, out: Path, name: str, steps: int) -> list[str]:
    """Overrides for a short run; tests append their own (later overrides win)."""
    return [
        f"model.path={model}",
        f"run.output_dir={out}",
        f"run.name={name}",
        f"run.total_steps={steps}",
        "model.tool_format=tags",
        "model.max_context_length=512",
        "megatron.micro_batch_tokens=4096",
        "megatron.lr=1.0e-3",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_turns=2",
        "rollout.max_prompt_tokens=128",
        "rollout.max_response_tokens=128",
        "rollout.max_new_tokens_per_turn=8",
        "gyms.train=[echo-procedural]",
        "gyms.test=[echo-procedural]",
        "checkpoint.save_hf=false",
        "logging.backends=[]",
    ]


# The learning task (tests/e2e/test_learning.py, tools/bench_async.py): EchoGym asking for "a" every turn, graded.
LEARNING_SETTINGS = [
    "run.seed=3",
    "rollout.prompts_per_step=8",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_turns=3",
    "rollout.max_response_tokens=256",
    "gyms.echo.alphabet=a",
    "checkpoint.every_steps=0",
    "logging.rollout_dump_every=0",
]


def learning_policy(scratch: Path) -> Path:
    """The learning task's policy: a tiny random Qwen3, format-warmed to say one random letter of "abcd"."""
    from tests.support.tiny_models import make_tiny_model
    from tests.support.warm_start import warm_start

    model = make_tiny_model("qwen3", scratch / "tiny", seed=3, tokenizer="char", num_hidden_layers=2)
    return warm_start(model, letters="abcd")


def logged_steps(run_dir: Path) -> list[int]:
    """The steps in `run_dir`'s metrics.jsonl so far, for a run that is still writing it (or was killed while
    writing it): an incomplete last line is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def drill_env(*drills: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment (`base`, else this process's) of a `userrl train` that runs these fault drills
    (`trainer/drills.py`: `USERRL_DRILLS`)."""
    return {**(os.environ if base is None else base), DRILLS_ENV: ",".join(drills)}


def train_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "userrl_megatron", "train", *overrides]


def train(
    overrides: list[str], timeout_s: float = RUN_TIMEOUT_S, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run `userrl train` to completion (in `env`, else this process's environment); the run's metrics.jsonl
    records."""
    subprocess.run(train_command(overrides), cwd=REPO, check=True, timeout=timeout_s, capture_output=True, env=env)
    out = next(o.removeprefix("run.output_dir=") for o in reversed(overrides) if o.startswith("run.output_dir="))
    name = next(o.removeprefix("run.name=") for o in reversed(overrides) if o.startswith("run.name="))
    return read_metrics(Path(out) / name / "metrics.jsonl")
