"""PNG charts of evaluations (matplotlib, Agg backend: no display needed).

`plot_steps`: a training run's step evaluations, score against step, one line per gym with its 95% band.
`plot_results`: one bar per gym (its headline score: `travel_score` for travel, `mean` elsewhere) with the 95%
interval as error bars. `plot_comparison`: the same bars grouped by gym, one colour per evaluation.
"""

from pathlib import Path
from typing import Any

from userrl_megatron.eval.results import headline


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bar(entry: dict[str, Any], gym: str) -> tuple[float, tuple[float, float]]:
    """The gym's score and its (below, above) error-bar lengths (0 where no interval exists)."""
    score = headline(gym, entry) or 0.0
    ci = entry["ci95"].get("travel_score" if gym == "travel" else "mean")
    return score, ((score - ci[0], ci[1] - score) if ci else (0.0, 0.0))


def plot_results(results: dict[str, Any], path: Path) -> Path:
    """Per-gym scores with 95% error bars of one evaluation, written to `path`."""
    return plot_comparison([(str(results["policy"].get("name", "policy")), results)], path)


def plot_comparison(runs: list[tuple[str, dict[str, Any]]], path: Path) -> Path:
    """Grouped bars: for each gym, one bar per (label, results) run, with 95% error bars."""
    plt = _pyplot()
    gyms = list(dict.fromkeys(g for _, r in runs for g in r["gyms"]))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(gyms) * max(1, len(runs)) / 2 + 2), 3.6))
    for i, (label, results) in enumerate(runs):
        xs, heights, below, above = [], [], [], []
        for j, gym in enumerate(gyms):
            if gym not in results["gyms"] or headline(gym, results["gyms"][gym]) is None:
                continue
            score, (lo, hi) = _bar(results["gyms"][gym], gym)
            xs.append(j - 0.4 + width * (i + 0.5))
            heights.append(score)
            below.append(lo)
            above.append(hi)
        ax.bar(xs, heights, width, yerr=[below, above], capsize=3, label=label)
    ax.set_xticks(range(len(gyms)), gyms)
    ax.set_ylabel("score (95% CI)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    ax.set_title("userrl eval")
    return _save(fig, path)


def plot_steps(steps: list[tuple[int, dict[str, Any]]], path: Path) -> Path:
    """Score vs training step, one line per gym (95% interval as a band), written to `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    gyms = list(dict.fromkeys(g for _, r in steps for g in r["gyms"]))
    for gym in gyms:
        xs, ys, lows, highs = [], [], [], []
        for step, results in steps:
            entry = results["gyms"].get(gym)
            if entry is None or headline(gym, entry) is None:
                continue
            score, (below, above) = _bar(entry, gym)
            xs.append(step)
            ys.append(score)
            lows.append(score - below)
            highs.append(score + above)
        line = ax.plot(xs, ys, marker="o", label=gym)[0]
        ax.fill_between(xs, lows, highs, alpha=0.2, color=line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("score (95% CI)")
    ax.legend(fontsize="small")
    ax.set_title("evaluation during training")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    """Write `fig` as a PNG at `path` and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path
