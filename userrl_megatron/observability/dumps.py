"""Episode dumps: one JSON object per episode, every turn with its tokens, text, reward and timing.

The one writer for `userrl rollout`'s rollouts.jsonl and the trainer's rollouts/step_N.jsonl, so both files
read the same way (`read_episodes`).
"""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from userrl_megatron.types import Episode


def episode_record(episode: Episode, step: int | None = None) -> dict[str, Any]:
    """The dump record of one episode (plain JSON values only)."""
    meta = episode.metadata
    record: dict[str, Any] = {
        "episode_id": meta.get("episode_id", ""),
        "group_id": episode.group_id,
        "gym": episode.task.gym,
        "task_id": episode.task.task_id,
        "finish_reason": episode.finish_reason,
        "reward": episode.total_reward,
        "turn_rewards": episode.turn_rewards,
        "prompt_tokens": episode.prompt_length,
        "response_tokens": len(episode.token_ids) - episode.prompt_length,
        "trained_tokens": sum(episode.loss_mask),
        "weight_version": episode.weight_version,
        "duration_s": meta.get("duration_s"),
        "prompt": [m.to_dict() for m in episode.task.prompt],
        "tools": episode.task.tools,
        "turns": [
            {
                "index": turn.index,
                "tokens": episode.token_ids[turn.start : turn.end],
                "text": turn.text,
                "action": turn.action,
                "feedback": turn.feedback,
                "reward": turn.reward,
                "weight_version": turn.weight_version,
                "finish_reason": turn.info.get("finish_reason"),
                "generate_s": turn.info.get("generate_s"),
                "step_s": turn.info.get("step_s"),
                # what the gym said of each step (tau2: termination_reason, reward_info with each criterion)
                **({"info": turn.info["step_info"]} if "step_info" in turn.info else {}),
            }
            for turn in episode.turns
        ],
    }
    if "messages" in meta:  # the conversation as the policy saw it (roles included): `userrl data sft-from-rollouts`
        record["messages"] = meta["messages"]
    for key in ("error", "close_error"):
        if key in meta:
            record[key] = meta[key]
    if step is not None:
        record = {"step": step, **record}
    return record


def write_episodes(
    path: str | Path, episodes: Iterable[Episode], step: int | None = None, replace: bool = False
) -> int:
    """Append the records of `episodes` to the JSONL file `path` (created with its folder), or with `replace` write
    it anew in one rename (a step's dump written again by a resumed run holds that run's episodes only); returns
    the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(path.name + ".tmp") if replace else path
    count = 0
    with target.open("w" if replace else "a", encoding="utf-8") as f:
        for episode in episodes:
            f.write(json.dumps(episode_record(episode, step), ensure_ascii=False) + "\n")
            count += 1
    if replace:
        target.replace(path)
    return count


def read_episodes(path: str | Path) -> list[dict[str, Any]]:
    """The records of an episode dump, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
