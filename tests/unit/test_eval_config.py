"""What `userrl eval` resolves before it starts anything: the gyms' evaluation settings, the tasks per source,
the short forms, and the weights fingerprint in the cache key."""

import argparse
from pathlib import Path

from userrl_megatron.commands.eval import short_overrides
from userrl_megatron.eval.evaluation import eval_config, eval_rollout, eval_tasks
from userrl_megatron.eval.policy import FINGERPRINT_CHUNK_BYTES, FINGERPRINT_CHUNKS, weights_fingerprint


def test_userrl_eval_gym_settings_apply_over_files_and_under_the_command_line(tmp_path: Path) -> None:
    cfg = eval_config([], [])
    assert (cfg.gyms.travel.search_correct_reward, cfg.gyms.travel.preference_correct_reward) == (0.2, 0.6)
    assert cfg.gyms.turtle.success_threshold == 1.0 and cfg.gyms.search.judge == "llm"
    yaml = tmp_path / "c.yaml"
    yaml.write_text("gyms:\n  travel:\n    search_correct_reward: 0.5\n")
    assert eval_config([str(yaml)], []).gyms.travel.search_correct_reward == 0.2  # eval settings win over files
    cli = eval_config([str(yaml)], ["gyms.travel.search_correct_reward=0.3"])
    assert cli.gyms.travel.search_correct_reward == 0.3  # the command line wins over both
    as_configured = eval_config([str(yaml)], ["eval.gym_settings=[]"])
    assert as_configured.gyms.travel.search_correct_reward == 0.5


def test_tasks_per_source_and_the_evaluation_rollout() -> None:
    cfg = eval_config([], ["gyms.test=[function-procedural,echo-procedural]", "eval.max_tasks=3"])
    tasks = eval_tasks(cfg)
    assert [t.gym for t in tasks] == ["function"] * 3 + ["echo"] * 3
    rollout = eval_rollout(eval_config([], ["eval.max_turns=16", "eval.temperature=0.5", "rollout.max_turns=4"]))
    assert (rollout.max_turns, rollout.temperature, rollout.reward_in_feedback) == (16, 0.5, False)
    assert eval_rollout(eval_config([], ["rollout.max_turns=4"])).max_turns == 4


def test_short_forms_are_dotted_overrides() -> None:
    args = argparse.Namespace(
        model="m", tasks=5, samples=None, temperature=None, max_turns=None, out="o", endpoint=None, api_model=None,
        engine_url=None, gyms="function-procedural, travel",
    )  # fmt: skip
    assert short_overrides(args) == [
        "model.path=m", "eval.max_tasks=5", "eval.out_dir=o", "gyms.test=[function-procedural,travel]",
    ]  # fmt: skip


def test_weights_fingerprint_follows_the_bytes(tmp_path: Path) -> None:
    size = FINGERPRINT_CHUNKS * FINGERPRINT_CHUNK_BYTES * 2  # large enough to be sampled in chunks
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    weights = bytearray(size)
    (model / "model.safetensors").write_bytes(weights)
    base = weights_fingerprint(model)
    assert weights_fingerprint(model) == base and len(base) == 32
    weights[0] = 1  # the first chunk
    (model / "model.safetensors").write_bytes(weights)
    assert weights_fingerprint(model) != base
    weights[0] = 0
    (model / "model.safetensors").write_bytes(weights)
    assert weights_fingerprint(model) == base
    (model / "config.json").write_text('{"a": 2}')  # small files count whole
    assert weights_fingerprint(model) != base
