"""`userrl eval` with the user simulator the run serves on the real SGLang 0.5.23 server (`user_sim.engines.backend:
sglang`, .venv-sglang on CPU, SmolLM2-135M-Instruct), through the real CLI: the gyms' reply schemas go to it as
`response_format` (`user_sim.structured: auto`, SGLang supports them, so no fallback to free text), and every call
is answered with a reply its gym takes. The policy is scripted (a local OpenAI-compatible server of ours,
`eval.endpoint`): a question in Telepathy's and Turtle's first turn, a guess in the second, so each turn puts
something to the simulator. On its first request the policy reads the engine's address from the run's log and asks
the engine without the run's key (and with a wrong one): refused with 401 while the engine serves the run.
"""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.openai_server import Answer, OpenAIServer, tool_call
from tests.support.tiny_run import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GYMS = ["telepathy", "turtle"]
ENGINE_LOG = re.compile(r"user simulator: \d+ engine\(s\) of \S+ at (http://\S+)/v1")
RUN_TIMEOUT_S = 1800.0  # a hang only: about 2-3 minutes on a busy 2-core machine


class Policy:
    """Telepathy's and Turtle's player: a question, then a guess. Its first request probes the simulator engine."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.probe: dict[str, Any] | None = None
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> Answer:
        with self.lock:
            if self.probe is None:
                self.probe = self._probe()
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn == 0:
            return tool_call("interact_with_env", {"choice": "action", "content": "Is it something you can eat?"})
        return tool_call("interact_with_env", {"choice": "answer", "content": "It is an apple."})

    def _probe(self) -> dict[str, Any]:
        """The engine's address from the run's log (the simulator is up before any episode), and the status of a
        request without the run's key and of one with a wrong key."""
        found = ENGINE_LOG.search(self.log.read_text(errors="replace"))
        if found is None:
            return {"url": None}
        url = found.group(1)
        chat = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        with httpx.Client(timeout=60) as http:
            return {
                "url": url,
                "models": http.get(f"{url}/v1/models").status_code,
                "chat": http.post(f"{url}/v1/chat/completions", json=chat).status_code,
                "wrong_key": http.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code,
            }


def test_userrl_eval_against_the_run_served_sglang_simulator(shared_data: Path, tmp_path: Path) -> None:
    from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON

    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    out, log = tmp_path / "eval", tmp_path / "eval.log"
    policy = Policy(log)
    start = time.monotonic()
    with OpenAIServer(policy) as server, log.open("w") as sink:
        command = [
            sys.executable, "-m", "userrl_megatron", "eval", "--config", "configs/usersim_cpu.yaml", "--no-plot",
            "--out", str(out), "--gyms", ",".join(GYMS), "--tasks", "1", "--samples", "1", "--max-turns", "2",
            "--endpoint", server.base_url, "--api-model", "scripted", "eval.api_key_env=none",
            f"gyms.data_dir={shared_data}",
            "eval.retries=0",
            "user_sim.structured=auto",
            "user_sim.engines.backend=sglang",
            "user_sim.engines.dtype=float32",  # SGLang would otherwise serve the fp32 checkpoint in fp16
            "rollout.sglang.device=cpu",
            "rollout.sglang.base_port=0",
            "rollout.sglang.max_total_tokens=8192",
            "rollout.sglang.startup_timeout_s=1200",  # a hung server only: start-up is 30-110 s on 2 cores
        ]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, timeout=RUN_TIMEOUT_S, stdout=sink, stderr=subprocess.STDOUT)
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["simulator"]["engines"]["model"] == "smollm2-135m-instruct"

    counters = results["user_sim"]
    share = counters["answered"] / counters["calls"] if counters["calls"] else 0.0
    print(f"user_sim: {counters['answered']:.0f} of {counters['calls']:.0f} calls answered ({share:.0%}) "
          f"in {time.monotonic() - start:.0f} s; probe {policy.probe}")  # fmt: skip
    # Two turns of two episodes, each turn a call (Turtle's guess: a story grade); every one answered and taken.
    assert counters["calls"] >= 2 * len(GYMS)
    assert counters["answered"] == counters["calls"] and counters["failures"] == 0.0, counters
    assert not {k: v for k, v in counters.items() if k.endswith("/bad_json") and v}, counters
    assert counters["retries"] == 0.0, counters  # every reply parsed at the first attempt
    assert (counters["structured"], counters["structured_fallback"]) == (1.0, 0.0)  # schema-constrained throughout
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["gym"] for e in episodes) == GYMS
    assert all(e["finish_reason"] != "user_sim_error" for e in episodes), episodes

    assert policy.probe is not None and policy.probe["url"], text[-4000:]
    assert (policy.probe["models"], policy.probe["chat"], policy.probe["wrong_key"]) == (401, 401, 401), policy.probe
