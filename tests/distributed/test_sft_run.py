"""`userrl sft` end to end on a tiny model (Ray, the Megatron actor on gloo): an interrupted run resumes at the
exact step and ends with the same weights as an uninterrupted one; `userrl train` starts from its checkpoint."""

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config import RootConfig, load_config
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TASKS = 6  # expert episodes of 385 tokens each under SmolLM2's template: two per step, three steps an epoch


def sft_config(model: Path, out: Path, name: str, *extra: str) -> RootConfig:
    return load_config(
        [],
        [
            f"model.path={model}",
            "model.tool_format=tags",
            f"run.output_dir={out}",
            f"run.name={name}",
            "megatron.micro_batch_tokens=1024",
            "rollout.max_prompt_tokens=512",
            "rollout.max_response_tokens=512",
            "sft.train_files=[expert:function-procedural]",
            "sft.val_files=[expert:function-procedural]",
            f"sft.expert_tasks={TASKS}",
            "sft.epochs=2",
            "sft.batch_tokens=800",
            "sft.lr=1.0e-3",
            "sft.warmup_ratio=0.34",
            "sft.val_every_steps=3",
            "sft.save_every_steps=2",
            "logging.backends=[]",
            *extra,
        ],
    )


def hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out |= load_file(file)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        "qwen3", tmp_path_factory.mktemp("sft") / "tiny", seed=3, tokenizer="smollm2", num_hidden_layers=2
    )


def test_interrupted_sft_resumes_at_the_step_with_identical_weights(
    ray_cluster: Any, model: Path, tmp_path: Path
) -> None:
    from userrl_megatron.sft.trainer import run_sft

    full = run_sft(sft_config(model, tmp_path, "full"))
    records = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    start = records[0]
    assert (start["data/train_samples"], start["data/total_steps"], start["data/rejected_rows"]) == (6, 6, 0)
    steps = records[1:]
    assert [r["actor/lr"] for r in steps] == pytest.approx(
        [5e-4, 1e-3, 9.045085e-4, 6.545085e-4, 3.454915e-4, 0.954915e-4], rel=1e-6
    )
    assert [r["sft/epoch"] for r in steps] == pytest.approx([1 / 3, 2 / 3, 1.0, 4 / 3, 5 / 3, 2.0])
    assert all(r["actor/episodes"] == 2 for r in steps)
    assert [("val/loss" in r) for r in records] == [True, False, False, True, False, False, True]
    assert records[6]["val/loss"] < records[0]["val/loss"]  # the expert's replies became likelier
    assert steps[-1]["sft/nll"] < steps[0]["sft/nll"]
    assert (full / "checkpoints" / "latest").read_text().strip() == "step_6"

    interrupted = sft_config(model, tmp_path, "resumed")
    run_sft(interrupted, stop_after=3)  # as if killed after step 3: its newest checkpoint is step 2's
    resumed_dir = tmp_path / "resumed"
    assert (resumed_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert not (resumed_dir / "hf").exists()
    run_sft(interrupted)
    resumed = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5, 6]  # step 3 again, once
    for got, want in zip(resumed[1:], steps, strict=True):
        assert got["sft/nll"] == pytest.approx(want["sft/nll"], rel=1e-6), got["step"]
        assert got["actor/lr"] == want["actor/lr"]
    a, b = hf_weights(full / "hf" / "step_6"), hf_weights(resumed_dir / "hf" / "step_6")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    # another run of the same command finds the run finished; other data refuses to resume it
    assert run_sft(interrupted) == resumed_dir
    assert len(read_metrics(resumed_dir / "metrics.jsonl")) == 7
    from userrl_megatron.errors import RunError

    with pytest.raises(RunError, match="trained on other data or another schedule"):
        run_sft(sft_config(model, tmp_path, "resumed", "sft.epochs=3"))


def test_rl_starts_from_the_sft_checkpoint(ray_cluster: Any, model: Path, tmp_path: Path) -> None:
    from userrl_megatron.sft.trainer import run_sft
    from userrl_megatron.trainer.driver import train

    sft_dir = run_sft(sft_config(model, tmp_path, "sft", "sft.epochs=1", "sft.val_files=[]"))
    sft_weights = hf_weights(sft_dir / "hf" / "step_3")
    base = hf_weights(model)
    rl = load_config(
        [],
        [
            f"model.path={model}",
            "model.tool_format=tags",
            f"run.output_dir={tmp_path}",
            "run.name=rl",
            "run.total_steps=1",
            "megatron.micro_batch_tokens=2048",
            "megatron.lr=1.0e-12",  # the update changes nothing measurable: the export shows the starting weights
            "rollout.prompts_per_step=1",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_turns=2",
            "rollout.max_new_tokens_per_turn=8",
            "logging.backends=[]",
            f"checkpoint.resume={sft_dir / 'checkpoints'}",
        ],
    )
    run = train(rl)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1]
    exported = hf_weights(run / "hf" / "step_1")
    assert exported.keys() == sft_weights.keys()
    for k in exported:
        assert torch.allclose(exported[k], sft_weights[k], atol=1e-8), k
    assert any(not torch.allclose(sft_weights[k], base[k], atol=1e-4) for k in sft_weights)

    # relaunched with more steps, the run resumes from its own checkpoint, not from the SFT one again
    train(replace(rl, run=replace(rl.run, total_steps=2)))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
