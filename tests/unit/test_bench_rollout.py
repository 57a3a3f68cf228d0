"""tools/bench_rollout.py runs end to end (tiny model, quick) and reports what docs/benchmarks.md quotes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_rollout_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "tools/bench_rollout.py", "--models", "tiny", "--concurrency", "1,4", "--quick"]
    # About 24 s on 2 cores: the bound is for a hang only.
    subprocess.run([*command, "--out", str(out)], cwd=REPO, check=True, capture_output=True, timeout=1200)
    report = json.loads(out.read_text())
    (tiny,) = report["models"]
    assert sorted(tiny["concurrency"]) == ["1", "4"]
    for run in tiny["concurrency"].values():
        assert run["episodes"] == 4 and run["generated_tokens"] > 0 and run["decode_forwards"] > 0
        assert run["tokens_per_s"] == pytest.approx(run["generated_tokens"] / run["seconds"], rel=2e-3)
    assert tiny["speedup_over_first"]["1"] == 1.0
    assert tiny["hf_generate"]["prompts"] == 2 and tiny["engine_c1_over_hf"] > 0
