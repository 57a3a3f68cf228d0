"""tools/bench_gyms.py runs and reports the tau fresh-database figures (a smoke run: the numbers are not checked)."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tau_fresh_db_benchmark_writes_its_json(shared_data, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gyms", REPO / "tools" / "bench_gyms.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--only", "tau_fresh_db", "--quick", "--data-dir", str(shared_data), "--out", str(out)]) == 0
    result = json.loads(out.read_text())["tau_fresh_db"]
    assert json.loads(capsys.readouterr().out) == {"tau_fresh_db": result}
    for name in ("retail", "airline"):
        row = result[name]
        assert row["episodes"] == 1
        assert row["episode_retained_kb"] < row["deepcopy_retained_kb"]
