"""tools/bench_gyms.py runs and reports its figures (smoke runs: only invariants of the numbers are checked)."""

import json

from tests.support.tools import load_tool


def test_tau_fresh_db_benchmark_writes_its_json(shared_data, tmp_path, capsys):
    bench = load_tool("bench_gyms")
    out = tmp_path / "bench.json"
    assert bench.main(["--only", "tau_fresh_db", "--quick", "--data-dir", str(shared_data), "--out", str(out)]) == 0
    result = json.loads(out.read_text())["tau_fresh_db"]
    assert json.loads(capsys.readouterr().out) == {"tau_fresh_db": result}
    for name in ("retail", "airline"):
        row = result[name]
        assert row["episodes"] == 1
        assert row["episode_retained_kb"] < row["deepcopy_retained_kb"]


def test_user_sim_concurrency_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--only", "user_sim_concurrency", "--quick", "--concurrency", "8", "--backends", "aiohttp", "httpx"]
    assert load_tool("bench_gyms").main([*args, "--delay", "0.05", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["user_sim_concurrency"]["rows"]
    assert [(r["http_backend"], r["max_concurrency"], r["calls"], r["failures"]) for r in rows] == [
        ("aiohttp", 8, 32.0, 0.0),
        ("httpx", 8, 32.0, 0.0),
    ]
    for row in rows:
        assert row["ideal_s"] == 2 * 0.05 * 2  # 2 turns x delay x ceil(16 episodes / 8 in flight)
        assert row["wall_s"] >= row["ideal_s"] and row["in_flight_max"] == 8.0
