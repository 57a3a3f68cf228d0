"""An evaluation's outputs: per-gym metrics from the episode records, results.json, episodes.jsonl and report.md.

Per gym (grouped by `Episode.task.gym`, items in task order): `items`, `episodes`, `infra_failed` (episodes lost
to the engine or the user simulator after their retries: counted, excluded from every score), `metrics` (see
`eval.metrics`) and `ci95` (Student t over the per-item scores of `mean`, of `travel_score` for travel, and of
each `pass^k` for the tau and tau2 gyms).
`overall` is `analyze.py`'s ranking score: the gym scores (`travel_score` for travel, `mean` elsewhere) averaged
with weights equal to each gym's item count.
"""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from userrl_megatron.eval import metrics as m

if TYPE_CHECKING:
    from userrl_megatron.types import EpisodeGroup

CI_METHOD = "95% Student t interval over per-item scores (an item's score is the mean over its passes)"
RESULTS, EPISODES, REPORT = "results.json", "episodes.jsonl", "report.md"


def _items(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Scored passes of each task id, in first-seen order (tasks whose passes all failed keep an empty list)."""
    items: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        passes = items.setdefault(record["task_id"], [])
        if not record.get("infra_failed"):
            passes.append(record)
    return items


def _interval(values: list[float]) -> list[float] | None:
    ci = m.t_interval(values)
    return [round(ci[0], 6), round(ci[1], 6)] if ci else None


def gym_results(gym: str, records: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """The results entry of one gym from its episode records."""
    items = _items(records)
    returns = [[m.episode_return(p["turn_rewards"]) for p in passes] for passes in items.values()]
    scored = [r for r in returns if r]
    per_item = m.mean_over_passes(scored)
    metrics: dict[str, float | None] = {"mean": None, "max": None}  # no score at all beats an unearned 0
    if scored:
        metrics = {"mean": m.micro_avg(scored), "max": m.micro_max(scored)}
    ci: dict[str, list[float] | None] = {"mean": _interval(per_item)}
    if gym == "travel" and scored:
        travel = [
            [m.travel_score([(t["action"], t["reward"]) for t in p["turns"]], m.travel_aspects(task)) for p in passes]
            for task, passes in items.items()
            if passes
        ]
        flat = [p["turn_rewards"] for passes in items.values() for p in passes]
        metrics["travel_score"] = m.micro_avg(travel)
        metrics["best_choices"] = sum(m.count_reward(r, m.TRAVEL_BEST) for r in flat) / max(1, len(flat))
        metrics["correct_choices"] = sum(m.count_reward(r, m.TRAVEL_CORRECT) for r in flat) / max(1, len(flat))
        ci["travel_score"] = _interval(m.mean_over_passes(travel))
    if gym in m.TAU_GYMS and scored:
        for k in range(1, samples + 1):
            metrics[f"pass^{k}"] = m.pass_hat_k(scored, k)
            ci[f"pass^{k}"] = _interval(m.pass_hat_k_items(scored, k))
    return {
        "items": len(scored),
        "items_unscored": len(items) - len(scored),
        "episodes": len(records),
        "infra_failed": sum(bool(r.get("infra_failed")) for r in records),
        "metrics": {k: (round(v, 6) if v is not None else None) for k, v in metrics.items()},
        "ci95": ci,
    }


def headline(gym: str, entry: dict[str, Any]) -> float | None:
    """The gym's score in the overall ranking: `travel_score` for travel, `mean` elsewhere (None: nothing scored)."""
    return entry["metrics"].get("travel_score") if gym == "travel" else entry["metrics"]["mean"]


def aggregate(records: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Per-gym entries (gyms in first-seen order) and the item-weighted overall score."""
    by_gym: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_gym.setdefault(record["gym"], []).append(record)
    gyms = {gym: gym_results(gym, recs, samples) for gym, recs in by_gym.items()}
    weight = sum(e["items"] for e in gyms.values())
    overall = sum((headline(g, e) or 0.0) * e["items"] for g, e in gyms.items()) / weight if weight else None
    return {
        "gyms": gyms,
        "overall": {
            "score": round(overall, 6) if overall is not None else None,
            "items": weight,
            "episodes": sum(e["episodes"] for e in gyms.values()),
            "infra_failed": sum(e["infra_failed"] for e in gyms.values()),
        },
    }


def group_records(groups: "list[EpisodeGroup]") -> list[dict[str, Any]]:
    """Episode records of rollout groups (a group per task, its episodes the passes), as `userrl eval` writes
    them: the trainer's periodic evaluation scores its episodes with the same code."""
    from userrl_megatron.observability.dumps import episode_record
    from userrl_megatron.rollout.summary import is_infra_failure

    records = []
    for group in groups:
        for sample, episode in enumerate(group.episodes):
            record = episode_record(episode)
            record.update(sample=sample, infra_failed=is_infra_failure(episode))
            records.append(record)
    return records


def write_episodes_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """All episode records (cached and new, infrastructure failures included), one JSON object per line."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_results(out_dir: str | Path) -> dict[str, Any]:
    """The results.json of a finished evaluation directory."""
    path = Path(out_dir) / RESULTS
    if not path.is_file():
        from userrl_megatron.errors import UserError

        raise UserError(f"{out_dir} holds no {RESULTS} (not a finished `userrl eval` output directory)")
    return json.loads(path.read_text(encoding="utf-8"))


def step_results(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """(step, results) of a training run's evaluations (`<run>/eval/step_N/results.json`), by step."""
    found = []
    for path in (run_dir / "eval").glob("step_*/results.json"):
        step = path.parent.name.removeprefix("step_")
        if step.isdigit():
            found.append((int(step), json.loads(path.read_text(encoding="utf-8"))))
    return sorted(found, key=lambda item: item[0])


def simulator_calls(counters: dict[str, float]) -> str:
    """The simulator's calls in a line: how many, how they ended (failures by kind), retries."""
    failures = {k.removeprefix("failures/"): int(v) for k, v in counters.items() if k.startswith("failures/")}
    kinds = "".join(f", {n} {kind}" for kind, n in sorted(failures.items()))
    if counters.get("unusable"):  # answered, but the gym could not use the reply (a needed key missing)
        kinds += f", {int(counters['unusable'])} answered but unusable"
    return (
        f"{int(counters.get('calls', 0))} ({int(counters.get('answered', 0))} answered, "
        f"{int(counters.get('cache_hits', 0))} from the cache, {int(counters.get('failures', 0))} failed{kinds}; "
        f"{int(counters.get('retries', 0))} retries)"
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _fmt_ci(ci: list[float] | None) -> str:
    return "-" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _metric(name: str, value: float | None, ci: list[float] | None) -> str:
    """A metric of the "other" column, with its 95% interval where it has one (pass^k)."""
    return f"{name} {_fmt(value)}" + (f" {_fmt_ci(ci)}" if ci else "")


def report_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-gym table (report.md and the terminal)."""
    header = ["gym", "items", "episodes", "infra failed", "mean", "95% CI", "max", "other"]
    rows = []
    for gym, entry in results["gyms"].items():
        other = {k: v for k, v in entry["metrics"].items() if k not in ("mean", "max")}
        rows.append(
            [
                gym,
                str(entry["items"]),
                str(entry["episodes"]),
                str(entry["infra_failed"]),
                _fmt(entry["metrics"]["mean"]),
                _fmt_ci(entry["ci95"]["mean"]),
                _fmt(entry["metrics"]["max"]),
                ", ".join(_metric(k, v, entry["ci95"].get(k)) for k, v in other.items()),
            ]
        )
    overall = results["overall"]
    rows.append(
        ["overall", str(overall["items"]), str(overall["episodes"]), str(overall["infra_failed"]),
         _fmt(overall["score"]), "", "", "item-weighted (travel: travel_score)"]
    )  # fmt: skip
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-style markdown table whose columns line up in a terminal too."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(lines)


def report_markdown(results: dict[str, Any]) -> str:
    """report.md: who was evaluated, how, and the per-gym table."""
    policy, protocol = results["policy"], results["protocol"]
    sim = results["simulator"]
    lines = [
        f"# Evaluation of {policy.get('name', '?')}",
        "",
        f"- policy: {json.dumps(policy, sort_keys=True)}",
        f"- user simulator: {json.dumps(sim, sort_keys=True) if sim else 'none (no gym needs one)'}",
        f"- protocol: {protocol['samples']} sample(s) per task, temperature {protocol['temperature']}, "
        f"max {protocol['max_turns']} turns, gyms settings {protocol['gym_settings'] or 'as configured'}",
        f"- confidence intervals: {results['ci_method']}",
        f"- {results['seconds']:.1f} s; episodes: {results['episodes_run']} run, {results['episodes_cached']} cached",
        *([f"- user simulator calls: {simulator_calls(results['user_sim'])}"] if results.get("user_sim") else []),
        "",
        markdown_table(*report_rows(results)),
        "",
    ]
    return "\n".join(lines)
