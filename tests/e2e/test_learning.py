"""A tiny policy learns a multi-turn task through the whole stack; with weight sync off it does not.

The task: EchoGym with alphabet "a" (every turn asks for the letter a), 3 turns, graded per-turn rewards. The
policy is a tiny random Qwen3 (character tokenizer) warmed up to answer in format with a random letter of
"abcd": it starts near chance (0.25 per turn) and must learn from rewards which letter pays. Both runs use
the real CLI (`userrl train`): Ray, the Megatron actor, the embedded engine, weight sync (verified against the
trainer's weights after every push), GRPO. The negative control keeps the engines on the initial weights:
the trainer's policy moves (its log-probs drift from the engine's) but the rollout reward cannot rise.
"""

from pathlib import Path

import pytest

from tests.support.tiny_run import LEARNING_SETTINGS, learning_policy, tiny_run, train
from userrl_megatron.config import load_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 14


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return learning_policy(tmp_path_factory.mktemp("policy"))


def _train(policy: Path, out: Path, name: str, *extra: str) -> list[dict]:
    return train([*tiny_run(policy, out, name, STEPS), *LEARNING_SETTINGS, *extra])


def _reward(records: list[dict], steps: slice) -> float:
    values = [r["rollout/reward_mean"] for r in records[steps]]
    return sum(values) / len(values)


def test_policy_learns_and_the_negative_control_does_not(policy: Path, tmp_path: Path) -> None:
    learned = _train(policy, tmp_path, "sync", "sync.verify=true")
    control = _train(policy, tmp_path, "nosync", "sync.enabled=false")
    assert [r["step"] for r in learned] == list(range(1, STEPS + 1))

    start, end = _reward(learned, slice(0, 3)), _reward(learned, slice(-3, None))
    assert start < 1.2 and end > start + 0.6, f"reward {start:.3f} -> {end:.3f}"
    # The engines hold the trainer's weights after every sync: checked directly, and seen in the log-probs.
    assert all(r["sync/verify_max_rel_diff"] <= 1e-5 for r in learned if "sync/verify_max_rel_diff" in r)
    assert max(r["mismatch/abs_logprob_diff"] for r in learned) < 1e-4
    assert learned[-1]["train/weight_version"] == STEPS - 1  # episodes of step N ran on the weights of step N-1

    control_start, control_end = _reward(control, slice(0, 3)), _reward(control, slice(-3, None))
    assert control_end < control_start + 0.3, f"control reward {control_start:.3f} -> {control_end:.3f}"
    assert all(r["train/weight_version"] == 0 for r in control)
    # The trainer's policy did move: its log-probs of the (stale) engines' tokens drift away.
    assert control[-1]["mismatch/abs_logprob_diff"] > 0.05


def test_policy_learns_with_one_step_off_rollouts(policy: Path, tmp_path: Path) -> None:
    """The rollout of step t+1 runs while step t trains: each step trains on turns one version behind the
    trainer, corrected by truncated importance sampling (on by default in this mode), and still learns."""
    learned = _train(policy, tmp_path, "one_step_off", "rollout.mode=one_step_off")
    assert [r["step"] for r in learned] == list(range(1, STEPS + 1))
    start, end = _reward(learned, slice(0, 3)), _reward(learned, slice(-3, None))
    assert start < 1.2 and end > start + 0.6, f"reward {start:.3f} -> {end:.3f}"
    # Step 1 trains on the initial weights' episodes; every later one on episodes of the weights before its own.
    assert [r["rollout/staleness_max"] for r in learned] == [0.0] + [1.0] * (STEPS - 1)
    assert [r["train/weight_version"] for r in learned] == [0.0, 0.0] + [float(s) for s in range(1, STEPS - 1)]
    assert all(r["batch/stale_groups"] == 0.0 for r in learned)
    assert all(0.0 < r["tis/weight"] <= 2.0 and 0.0 <= r["tis/clip_frac"] <= 1.0 for r in learned if "tis/weight" in r)
    saved = load_config([str(tmp_path / "one_step_off" / "config.yaml")], check=False)
    assert saved.algo.tis_cap == 2.0  # the run directory's config is the resolved one, the config that ran


def test_policy_learns_with_partial_rollouts_and_over_sampling(policy: Path, tmp_path: Path) -> None:
    """one_step_off with partial rollouts (a push aborts the turns in flight; they are generated again on the new
    weights) and 4 groups over-sampled per step: each step trains on the first 8 groups to finish with unequal
    scores; unfinished ones carry over, and none lags more than rollout.max_staleness = 1 version."""
    extra = ["rollout.mode=one_step_off", "rollout.partial=true", "rollout.over_sample_groups=4"]
    learned = _train(policy, tmp_path, "partial", *extra)
    assert [r["step"] for r in learned] == list(range(1, STEPS + 1))
    start, end = _reward(learned, slice(0, 3)), _reward(learned, slice(-3, None))
    assert start < 1.2 and end > start + 0.6, f"reward {start:.3f} -> {end:.3f}"
    assert all(r["rollout/groups_used"] <= 8 for r in learned)
    assert learned[0]["rollout/groups_started"] == 12.0  # 8 + 4 in flight; later steps top up what was used
    started = sum(r["rollout/groups_started"] for r in learned)
    settled = sum(r["rollout/groups_used"] + r["rollout/groups_dropped"] for r in learned)
    assert started == settled + learned[-1]["rollout/groups_carried"]  # every group is used, dropped or carried
    assert all(r.get("rollout/staleness_max", 0.0) <= 1.0 for r in learned)
