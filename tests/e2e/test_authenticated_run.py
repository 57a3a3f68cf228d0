"""A run whose engines and router require a key given only in the environment: two embedded engines behind the
real sglang-router train two steps (generation through the router, weight sync to each engine, both keyed),
and the key shows nowhere in the run's console, logs or files."""

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, tiny_run, train_command
from userrl_megatron.fleet.auth import DEFAULT_KEY_ENV
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_engines_and_a_router_train_with_the_key_from_the_environment(tmp_path: Path) -> None:
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=2, tokenizer="char", num_hidden_layers=2)
    key = secrets.token_urlsafe(32)
    overrides = [
        *tiny_run(model, tmp_path, "keyed", 2),
        "rollout.num_engines=2",
        "rollout.router=sglang",
        "sync.verify=true",  # each engine's weights read back (a keyed control call) after every sync
    ]
    done = subprocess.run(
        train_command(overrides),
        cwd=REPO,
        env={**os.environ, DEFAULT_KEY_ENV: key},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "keyed"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert [r["train/weight_version"] for r in records] == [0, 1]
    assert all(r["sync/verify_max_rel_diff"] <= 1e-5 for r in records)
    assert all(r["rollout/infra_failed"] == 0 for r in records)

    text = (run / "run.log").read_text()
    assert f"engines and router require the API key in ${DEFAULT_KEY_ENV}" in text  # not a random one
    assert f"launching {DEFAULT_KEY_ENV}=<secret> " in text  # the router (the engines start on Ray's workers)

    files = [f for f in run.rglob("*") if f.is_file()]
    logs = [f.relative_to(run).as_posix() for f in files if f.suffix == ".log"]
    assert "run.log" in logs and any(name.endswith("router.log") for name in logs), logs
    for f in files:
        assert key.encode() not in f.read_bytes(), f
    assert key not in done.stdout + done.stderr
