"""The README's first command, guarded: `configs/quickstart.yaml` itself (the same model, gym, budgets and
evaluation; only fewer steps, tasks and test tasks), with the update of step 1 skipped (its checkpoint then precedes any
optimizer step) and the engine killed after step 2's rollout (restarted and repaired before the final evaluation
runs on it). The run must not collapse."""

import subprocess
from pathlib import Path

import pytest

from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, drill_env, train_command
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 2


def test_quickstart_config_survives_a_skipped_update_and_an_engine_restart(tmp_path: Path) -> None:
    overrides = [f"run.output_dir={tmp_path}", f"run.total_steps={STEPS}", f"eval.every_steps={STEPS}"]
    # The scoring path and the step loop themselves at half the quickstart's width (16 episodes a step, 16 test
    # tasks); the README's scores are measured runs of the whole config.
    overrides += ["eval.max_tasks=16", "rollout.prompts_per_step=4"]
    overrides.append("checkpoint.every_steps=1")  # step 1 (no update) is then checkpointed, as in a longer run
    command = train_command(["--config", "configs/quickstart.yaml", *overrides])
    env = drill_env("skip_update@1", "kill_engine@2")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "quickstart"
    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    assert sorted(records) == [0, *range(1, STEPS + 1)]  # step 0: the score before training
    for step in range(1, STEPS + 1):
        record = records[step]
        assert record["rollout/generated_tokens"] > 0 and record["rollout/infra_failed"] == 0, record
        assert "rollout/reward_mean" in record
        # on-policy (one optimizer step a step): the scoring pass computes only the KL's reference log-probs,
        # and only for a step that trains
        assert ("timing/logprobs" in record) == ("actor/loss" in record), record
    assert "actor/loss" not in records[1]  # skipped: step 1's checkpoint had no optimizer state to save
    assert records[STEPS]["rollout/engine_restarts"] >= 1
    assert "eval/reward_mean" in records[0] and "eval/reward_mean" in records[STEPS]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    assert (run / "hf" / f"step_{STEPS}" / "config.json").is_file()
    assert "test-split score (greedy, same tasks):" in result.stdout
