"""`userrl eval --engine-url` against every engine (both backends, each model): its model on a few FunctionGym tasks
through the native API, token in / token out, with the quickstart's settings."""

import json
from pathlib import Path

from tests.conformance.conftest import Engine
from userrl_megatron.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_eval_against_a_running_engine(engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / engine.backend
    args = [
        "eval", "-c", str(REPO / "configs" / "quickstart.yaml"), "--engine-url", engine.url,
        f"model.path={engine.model_dir}", "--gyms", "function-procedural", "--tasks", "4", "--out", str(out),
        "--no-plot",
    ]  # fmt: skip
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["policy"]["kind"] == "engine" and results["policy"]["url"] == engine.url
    function = results["gyms"]["function"]
    assert (function["items"], function["episodes"], function["infra_failed"]) == (4, 4, 0)
    records = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert all(r["turns"] and r["trained_tokens"] > 0 for r in records)
    # greedy: the score is the share of tasks whose return is 1
    assert function["metrics"]["mean"] == sum(r["reward"] for r in records) / 4
