"""A run's rollout dumps (`rollouts/step_N.jsonl`) -> SFT rows: rejection-sampling fine-tuning data in one step.

Every dumped episode whose reward is at least `min_reward` becomes a row (its task prompt, tools, assistant turns
and replies, from the record's `messages`); with `best_per_group` only the best such episode of each group (ties:
the earliest) is kept. Episodes that ended in an infrastructure failure (engine, gym or user-simulator errors)
are never kept. A record that cannot become a row (a dump written before records carried `messages`) is counted
with its reason.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from userrl_megatron.errors import UserError
from userrl_megatron.observability.dumps import read_episodes
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.sft.experts import conversation_row
from userrl_megatron.sft.rows import Rejection, RowError, SFTRow, check_conversation

FAILED = ("gym_error", "user_sim_error", "engine_error")


@dataclass
class Selection:
    """What came out of the dumps."""

    rows: list[SFTRow] = field(default_factory=list)
    episodes: int = 0  # records read
    below: int = 0  # records under min_reward (or failed)
    not_best: int = 0  # dropped by best_per_group
    rejected: list[Rejection] = field(default_factory=list)


def dump_files(run_dir: str | Path) -> list[Path]:
    """A run's rollout dumps in step order; a single .jsonl file (a dump, or `userrl rollout`'s output) as is."""
    path = Path(run_dir)
    if path.is_file():
        return [path]
    files = sorted((path / "rollouts").glob("step_*.jsonl"), key=lambda p: int(p.stem.removeprefix("step_")))
    if not files:
        raise UserError(
            f"{path}: no rollouts/step_N.jsonl dumps (is it a run directory with logging.rollout_dump_every > 0?)"
        )
    return files


def select(run_dir: str | Path, chat: ChatTemplate, min_reward: float = 1.0, best_per_group: bool = False) -> Selection:
    """The rows of the episodes of `run_dir`'s dumps that pass the filters."""
    out = Selection()
    kept: list[tuple[dict[str, Any], str]] = []
    for path in dump_files(run_dir):
        for number, record in enumerate(read_episodes(path), start=1):
            out.episodes += 1
            if record.get("finish_reason") in FAILED or record.get("reward", 0.0) < min_reward:
                out.below += 1
                continue
            kept.append((record, f"{path}:{number}"))
    if best_per_group:
        best: dict[tuple[Any, str], tuple[dict[str, Any], str]] = {}
        for record, source in kept:
            key = (record.get("step"), record["group_id"])  # group ids are unique per step
            if key not in best or record["reward"] > best[key][0]["reward"]:
                best[key] = (record, source)
        out.not_best = len(kept) - len(best)
        kept = list(best.values())
    for record, source in kept:
        try:
            out.rows.append(record_row(record, chat, source))
        except RowError as e:
            out.rejected.append(Rejection(source, str(e)))
    return out


def record_row(record: dict[str, Any], chat: ChatTemplate, source: str) -> SFTRow:
    """The row of one dump record; RowError if the record lacks what a row needs."""
    if "messages" not in record:
        raise RowError("the record has no messages (dumps written before they carried the conversation)")
    row = conversation_row(record["prompt"], record.get("tools") or [], record["messages"], chat, source)
    check_conversation(row.messages)
    return row


def summary(selection: Selection, files: Iterable[Path]) -> str:
    """One line for the console."""
    return (
        f"{len(selection.rows)} rows from {selection.episodes} episodes in {len(list(files))} dump(s): "
        f"{selection.below} below the reward bar or failed, {selection.not_best} not the best of their group, "
        f"{len(selection.rejected)} rejected"
    )
