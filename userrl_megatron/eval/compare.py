"""`userrl eval --compare DIR ...`: finished evaluations side by side, each against the first (the baseline).

Per gym and run: the headline score (`travel_score` for travel, `mean` elsewhere) with its 95% interval, and
the difference to the baseline with a 95% interval: paired (Student t over per-task differences) when both runs
scored the same tasks, else Welch's unpaired interval over the per-item scores. Per-item scores are read back from
each directory's episodes.jsonl.
"""

import json
from pathlib import Path
from typing import Any

from userrl_megatron.eval import metrics as m
from userrl_megatron.eval.results import EPISODES, headline, markdown_table, read_results


def item_scores(out_dir: Path, gym: str) -> dict[str, float]:
    """Task id -> the task's score (mean over its scored passes) of `gym` in an evaluation directory."""
    passes: dict[str, list[float]] = {}
    with (out_dir / EPISODES).open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["gym"] != gym or record.get("infra_failed"):
                continue
            if gym == "travel":
                turns = [(t["action"], t["reward"]) for t in record["turns"]]
                score = m.travel_score(turns, m.travel_aspects(record["task_id"]))
            else:
                score = m.episode_return(record["turn_rewards"])
            passes.setdefault(record["task_id"], []).append(score)
    return {task: sum(v) / len(v) for task, v in passes.items()}


def difference_interval(base: dict[str, float], other: dict[str, float]) -> tuple[tuple[float, float] | None, str]:
    """95% interval of other - base and its method ("paired" over shared tasks, or "welch")."""
    if base and set(base) == set(other):
        return m.t_interval([other[t] - base[t] for t in base]), "paired"
    return m.welch_interval(list(base.values()), list(other.values())), "welch"


def compare_runs(dirs: list[Path]) -> dict[str, Any]:
    """The comparison of evaluation directories (the first is the baseline)."""
    runs = [(str(d), read_results(d)) for d in dirs]
    gyms = list(dict.fromkeys(g for _, r in runs for g in r["gyms"]))
    table: dict[str, list[dict[str, Any]]] = {}
    for gym in gyms:
        base_dir = dirs[0]
        base = item_scores(base_dir, gym) if gym in runs[0][1]["gyms"] else {}
        rows = []
        for d, (label, results) in zip(dirs, runs, strict=True):
            entry = results["gyms"].get(gym)
            if entry is None or headline(gym, entry) is None:
                rows.append({"run": label, "missing": True})
                continue
            key = "travel_score" if gym == "travel" else "mean"
            row = {"run": label, "items": entry["items"], "score": headline(gym, entry), "ci95": entry["ci95"][key]}
            base_entry = runs[0][1]["gyms"].get(gym)
            if d != base_dir and base and base_entry is not None and headline(gym, base_entry) is not None:
                ci, method = difference_interval(base, item_scores(d, gym))
                row["difference"] = round(row["score"] - (headline(gym, base_entry) or 0.0), 6)
                row["difference_ci95"] = [round(ci[0], 6), round(ci[1], 6)] if ci else None
                row["difference_method"] = method
            rows.append(row)
        table[gym] = rows
    return {"baseline": str(dirs[0]), "runs": [label for label, _ in runs], "gyms": table, "results": runs}


def comparison_markdown(comparison: dict[str, Any]) -> str:
    """compare.md: one table, a row per (gym, run)."""
    header = ["gym", "run", "items", "score", "95% CI", "difference", "difference 95% CI"]
    rows = []
    for gym, entries in comparison["gyms"].items():
        for row in entries:
            if row.get("missing"):
                rows.append([gym, row["run"], "-", "-", "-", "-", "-"])
                continue
            ci, dci = row["ci95"], row.get("difference_ci95")
            diff = row.get("difference")
            rows.append(
                [
                    gym,
                    row["run"],
                    str(row["items"]),
                    f"{row['score']:.3f}",
                    f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-",
                    "baseline" if diff is None else f"{diff:+.3f}",
                    f"[{dci[0]:+.3f}, {dci[1]:+.3f}] ({row['difference_method']})" if dci else "-",
                ]
            )
    return f"# Comparison (baseline: {comparison['baseline']})\n\n{markdown_table(header, rows)}\n"


def write_comparison(comparison: dict[str, Any], out: Path, plot: bool = True) -> None:
    """compare.json, compare.md and (with `plot`) compare.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    plain = {k: v for k, v in comparison.items() if k != "results"}
    (out / "compare.json").write_text(json.dumps(plain, indent=2) + "\n", encoding="utf-8")
    (out / "compare.md").write_text(comparison_markdown(comparison), encoding="utf-8")
    if plot:
        from userrl_megatron.eval.plots import plot_comparison

        plot_comparison(comparison["results"], out / "compare.png")
