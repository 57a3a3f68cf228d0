"""The trainer's periodic evaluation in `userrl eval`'s format: `<run>/eval/step_N/` gets results.json,
episodes.jsonl and report.md with the same metrics, intervals and tables (`eval.results`)."""

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from userrl_megatron.eval.results import CI_METHOD, aggregate, group_records

if TYPE_CHECKING:
    from userrl_megatron.config.schema import RootConfig
    from userrl_megatron.types import EpisodeGroup


def write_step_evaluation(
    cfg: "RootConfig", out_dir: Path, step: int, groups: "list[EpisodeGroup]", started: float
) -> None:
    """Write the evaluation of training step `step` (its episodes in `groups`) to `out_dir`."""
    from userrl_megatron.eval.evaluation import simulator_identity, versions, write_outputs

    records = group_records(groups)
    samples = cfg.eval.n_samples_per_prompt
    gyms = {g.task.gym for g in groups}
    results = {
        "step": step,
        "policy": {"name": f"{cfg.run.name} step {step}", "kind": "training", "run": cfg.run.name, "step": step},
        "simulator": simulator_identity(cfg) if any(_needs_user_sim(g) for g in gyms) else None,
        "protocol": {
            "max_turns": cfg.rollout.max_turns,
            "max_prompt_tokens": cfg.rollout.max_prompt_tokens,
            "max_response_tokens": cfg.rollout.max_response_tokens,
            "max_new_tokens_per_turn": cfg.rollout.max_new_tokens_per_turn,
            "reward_in_feedback": cfg.rollout.reward_in_feedback,
            "samples": samples,
            "temperature": cfg.eval.temperature,
            "sources": list(cfg.gyms.test),
            "max_tasks": cfg.eval.max_tasks,
            "gym_settings": [],  # training's gym settings (the gyms section as configured)
        },
        "ci_method": CI_METHOD,
        **aggregate(records, samples),
        "seconds": round(time.perf_counter() - started, 2),
        "episodes_run": len(records),
        "episodes_cached": 0,
        "versions": versions(),
        "config": dataclasses.asdict(cfg),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(out_dir, results, records)


def _needs_user_sim(gym: str) -> bool:
    """Does gym `gym` call the user simulator (False for names outside the registry, e.g. `userrl plan`'s)?"""
    from gyms.base import gym_spec

    try:
        return gym_spec(gym).needs_user_sim
    except KeyError:
        return False
