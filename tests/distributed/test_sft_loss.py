"""The SFT loss through the Megatron actor equals a plain `transformers` cross-entropy, under DP, TP and PP.

The reference runs the HF model one conversation at a time and sums the token cross-entropy of the trained
tokens over the whole batch, divided by the batch's trained-token count. Megatron splits the batch across
data-parallel ranks and micro-batches, so equality shows the normaliser is the global token count.
"""

from pathlib import Path

import pytest
import torch

from tests.support.distributed import build_actor, init_world, megatron_config, random_batch, spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import AlgoConfig
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

SFT = AlgoConfig(policy_loss="sft_nll", loss_agg="token-mean")
LENGTHS = [12, 30, 7, 22, 16, 9]
LAYOUTS = {"dp2": {"use_distributed_optimizer": False}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
SCHEDULE = {"lr_warmup_steps": 2, "lr_schedule": "cosine", "lr_decay_steps": 4, "grad_clip": 0.5, "lr": 2e-3}
GRAD_RTOL = 1e-4  # TP's differently ordered fp32 sums (see test_actor_training.py)


def reference(model_dir: Path, batch: TrainBatch) -> tuple[float, dict[str, torch.Tensor]]:
    """(Σ token NLL on the loss mask / Σ mask, HF gradients) from `transformers`, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = torch.zeros(())
    for ids, mask in zip(batch.token_ids, batch.loss_mask, strict=True):
        labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
        total = total + torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
    loss = total / batch.num_trained_tokens
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def _run(rank: int, world: int, port: int, model_dir: Path, batch: TrainBatch) -> dict:
    from userrl_megatron.megatron.export import export_hf

    out = {}
    for name, layout in LAYOUTS.items():
        cfg = megatron_config(micro_batch_tokens=32, **layout, **SCHEDULE)
        init_world(rank, world, port, cfg)
        actor = build_actor(model_dir, cfg, SFT)
        outputs = actor._accumulate_gradients(batch)
        loss = actor._reduce_metrics(outputs, rollout=False)["actor/loss"]
        modules = [c.module for c in actor.chunks]
        grads = {k: v.numpy().copy() for k, v in export_hf(modules, actor.converter, actor.layout, tensor_of=_grad)}
        steps = [actor.train_step(batch) for _ in range(3)]
        out[name] = (loss, grads, steps)
    return out


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    return p.main_grad


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("sft") / "qwen2", seed=7)


def test_sft_loss_and_gradients_equal_transformers_under_every_layout(model_dir: Path) -> None:
    batch = random_batch(256, LENGTHS, seed=21)  # random masks: several trained spans per row, as multi-turn
    batch.advantages = [[0.0] * len(ids) for ids in batch.token_ids]  # ignored by the SFT loss
    ref_loss, ref_grads = reference(model_dir, batch)
    results = spawn(_run, 2, model_dir, batch)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name in LAYOUTS:
        loss, grads, steps = results[0][name]
        grads = {**results[1][name][1], **grads}  # PP: each stage exports its own tensors
        assert abs(loss - ref_loss) <= 1e-6, (name, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        worst = max(float((torch.from_numpy(grads[k]) - ref_grads[k]).abs().max()) for k in grads)
        assert worst <= GRAD_RTOL * scale, (name, worst, scale)
        assert steps == results[1][name][2]  # every rank reports the same metrics
        # the first step's loss is the reference NLL; warm-up: lr 1e-3 then 2e-3, then the cosine decay
        assert steps[0]["actor/loss"] == pytest.approx(ref_loss, abs=1e-6)
        assert steps[0]["sft/nll"] == pytest.approx(ref_loss, abs=1e-6)
        assert [s["actor/lr"] for s in steps] == pytest.approx([1e-3, 2e-3, 1e-3], rel=1e-12)
        assert steps[0]["actor/grad_norm"] > SCHEDULE["grad_clip"]  # clipping was exercised
        assert steps[2]["actor/loss"] < steps[0]["actor/loss"]
    for name in ("tp2", "pp2"):  # the same three optimizer steps as plain data parallelism
        for got, want in zip(results[0][name][2], results[0]["dp2"][2], strict=True):
            assert got["actor/loss"] == pytest.approx(want["actor/loss"], abs=1e-5)
            assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=GRAD_RTOL)
