"""The end-of-run summary: a table of the run's steps from metrics.jsonl, and where its artifacts are."""

import shutil
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from userrl_megatron.observability import read_metrics

ANSWERED_SHARE = "user_sim/answered_share"  # derived: (calls - failures - unusable) / calls, none without calls

COLUMNS = (
    ("reward", "rollout/reward_mean", "{:.3f}"),
    ("infra fail", "rollout/infra_failed", "{:.0f}"),
    ("eval", "eval/reward_mean", "{:.3f}"),
    ("turns", "rollout/turns_mean", "{:.2f}"),
    ("tokens", "rollout/generated_tokens", "{:.0f}"),
    ("loss", "actor/loss", "{:+.4f}"),
    ("grad norm", "actor/grad_norm", "{:.3f}"),
    ("|Δlogp|", "mismatch/abs_logprob_diff", "{:.2e}"),
    # Shares of the step's episodes that ended on an engine / user-simulator error (0 when none did); "infra
    # fail" above counts the episodes left out of the step because of them.
    ("engine err", "rollout/finish/engine_error", "{:.0%}"),
    ("sim err", "rollout/finish/user_sim_error", "{:.0%}"),
    # The user simulator's calls in the step and the share of them it answered with a usable reply (not failed
    # after its retries: `bad_json`, a timeout, ...; nor unusable to the gym); "-" for a run without a simulator.
    ("sim calls", "user_sim/calls", "{:.0f}"),
    ("sim ok", ANSWERED_SHARE, "{:.0%}"),
    ("rollout s", "timing/rollout", "{:.1f}"),
    ("logprob s", "timing/logprobs", "{:.1f}"),
    ("train s", "timing/train", "{:.1f}"),
    ("sync s", "timing/sync", "{:.2f}"),
    ("ckpt s", "timing/checkpoint", "{:.1f}"),
    ("step s", "timing/step", "{:.1f}"),
)
# Metrics logged only when non-zero (finish-reason shares exist only for reasons that occurred): 0 when the record
# holds the key that says the metric applies (a rollout ran; the run has a user simulator), "-" otherwise.
ZERO_WHEN_ABSENT = {
    "rollout/finish/engine_error": "rollout/episodes",
    "rollout/finish/user_sim_error": "user_sim/calls",
}


def print_report(run_dir: Path, console: Console | None = None) -> None:
    """Print one row per step and the run's checkpoint and HF export locations."""
    console = console or Console(highlight=False, width=max(shutil.get_terminal_size().columns, 170))
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    table = Table(title=f"run {run_dir}")
    table.add_column("step", justify="right")
    for title, _, _ in COLUMNS:
        table.add_column(title, justify="right")
    for record in records:
        cells = [_cell(record, key, fmt) for _, key, fmt in COLUMNS]
        table.add_row(str(record["step"]), *cells)
    console.print(table)
    scores = [(r["step"], r["eval/reward_mean"]) for r in records if "eval/reward_mean" in r]
    if len(scores) > 1 and scores[0][0] == 0:
        (_, before), (last, after) = scores[0], scores[-1]
        console.print(
            f"test-split score ({_decoding(run_dir)}, same tasks): {before:.3f} before training -> {after:.3f} after"
            f" step {last}"
        )
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        console.print(f"latest checkpoint: {run_dir / 'checkpoints' / latest.read_text().strip()}")
    exports = sorted((run_dir / "hf").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if exports:
        console.print(f"Hugging Face export: {exports[-1]}")


def _cell(record: dict, key: str, fmt: str) -> str:
    value = _answered_share(record) if key == ANSWERED_SHARE else record.get(key)
    if value is None and ZERO_WHEN_ABSENT.get(key, "") in record:
        value = 0
    return fmt.format(value) if isinstance(value, int | float) else "-"


def _decoding(run_dir: Path) -> str:
    """How the run's evaluation decodes (its saved config's `eval.temperature`): "greedy", or the temperature."""
    config = run_dir / "config.yaml"
    temperature = 0.0
    if config.is_file():
        temperature = float((yaml.safe_load(config.read_text()) or {}).get("eval", {}).get("temperature") or 0.0)
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"


def _answered_share(record: dict) -> float | None:
    """The share of the step's simulator calls that did not fail and that the gym could use (cache hits count)."""
    calls = record.get("user_sim/calls")
    if not calls:
        return None
    return (calls - record.get("user_sim/failures", 0.0) - record.get("user_sim/unusable", 0.0)) / calls
