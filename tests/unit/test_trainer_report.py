"""The end-of-run table: one row per step (with infrastructure failures and eval scores) and before/after."""

import json
from pathlib import Path

from rich.console import Console

from userrl_megatron.trainer.report import print_report


def test_table_rows_and_the_before_after_line(tmp_path: Path) -> None:
    records = [
        {"step": 0, "eval/reward_mean": 0.25},
        {"step": 1, "rollout/reward_mean": 0.5, "rollout/infra_failed": 2.0},
        {"step": 2, "rollout/reward_mean": 0.75, "rollout/infra_failed": 0.0, "eval/reward_mean": 0.625},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    console = Console(record=True, width=250)
    print_report(tmp_path, console)
    text = console.export_text()
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]] for line in text.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()}  # fmt: skip
    assert rows == {"0": ["-", "-", "0.250"], "1": ["0.500", "2", "-"], "2": ["0.750", "0", "0.625"]}
    assert "test-split score (greedy, same tasks): 0.250 before training -> 0.625 after step 2" in text
    (tmp_path / "config.yaml").write_text("eval:\n  temperature: 1.0\n")  # the run's config, as the trainer saves it
    console = Console(record=True, width=250)
    print_report(tmp_path, console)
    text = console.export_text()
    assert (
        "test-split score (sampled at temperature 1, same tasks): 0.250 before training -> 0.625 after step 2" in text
    )


def test_simulator_calls_and_the_share_answered(tmp_path: Path) -> None:
    records = [
        {
            "step": 1,
            "rollout/reward_mean": 0.5,
            "user_sim/calls": 20.0,
            "user_sim/failures": 1.0,
            "user_sim/unusable": 1.0,
        },
        {"step": 2, "rollout/reward_mean": 0.25, "user_sim/calls": 0.0, "user_sim/failures": 0.0},
        {"step": 3, "rollout/reward_mean": 0.0},  # no simulator in the run
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    console = Console(record=True, width=300)
    print_report(tmp_path, console)
    lines = console.export_text().splitlines()
    header = [c.strip() for c in next(line for line in lines if "sim calls" in line).split("┃")]
    calls, share = header.index("sim calls"), header.index("sim ok")
    rows = {cells[1].strip(): (cells[calls].strip(), cells[share].strip()) for line in lines
            if line.startswith("│") and (cells := line.split("│"))[1].strip().isdigit()}  # fmt: skip
    assert rows == {"1": ("20", "90%"), "2": ("0", "-"), "3": ("-", "-")}
