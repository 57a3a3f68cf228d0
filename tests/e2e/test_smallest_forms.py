"""Each command's smallest form works on the embedded model with no config file: nothing model-dependent has to
be set (`model.tool_format` resolves from the chat template, `run.name` from the command and the model).

The only overrides cut sizes (steps, tasks, turns, tokens) to keep the suite short; none depends on the model.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.tiny_run import RUN_TIMEOUT_S
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MODEL = "smollm2-135m-instruct"
SMALL = ["rollout.max_turns=1", "rollout.max_new_tokens_per_turn=16"]


def userrl(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run `userrl ARGS` in `cwd` (outputs land under it) to completion."""
    command = [sys.executable, "-m", "userrl_megatron", *args]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)


def test_train_with_only_the_model(tmp_path: Path) -> None:
    sizes = ["run.total_steps=1", "rollout.prompts_per_step=1", "rollout.n_samples_per_prompt=2", *SMALL]
    result = userrl(["train", f"model.path={MODEL}", *sizes], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "runs" / f"train-{MODEL}"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]
    assert (run / "checkpoints" / "step_1" / "hf_metadata" / "config.json").is_file()
    assert (run / "hf" / "step_1" / "model.safetensors").is_file()


def test_eval_with_only_the_model(tmp_path: Path) -> None:
    result = userrl(["eval", "--model", MODEL, "--tasks", "2", "--max-turns", "1", "--no-plot"], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((tmp_path / "runs" / f"eval-{MODEL}" / "eval" / "results.json").read_text())
    assert results["gyms"]["function"]["items"] == 2


def test_rollout_with_only_the_model(tmp_path: Path) -> None:
    result = userrl(["rollout", "--model", MODEL, "--limit", "1", *SMALL], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    episodes = (tmp_path / "runs" / f"rollout-{MODEL}" / "rollouts.jsonl").read_text().splitlines()
    assert len(episodes) == 1 and json.loads(episodes[0])["gym"] == "function"


def test_serve_with_only_the_model(tmp_path: Path) -> None:
    # --port 0: the system picks a free port (the default, SGLang's 30000, may be taken on a test machine) and
    # the server's log line names it.
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "userrl_megatron", "serve", "--model", MODEL, "--port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    try:
        deadline = time.monotonic() + 600  # a bound on waiting for start-up, not a timing assertion
        while not (found := re.search(rf"serving {MODEL} on (http://127\.0\.0\.1:\d+)", log_path.read_text())):
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no server within 10 minutes"
            time.sleep(0.5)
        url = found.group(1)
        assert not url.endswith(":0")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            answer = json.loads(reply.read())
        assert answer["usage"]["completion_tokens"] >= 1
        assert answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(timeout=120) == 0, log_path.read_text()[-3000:]
