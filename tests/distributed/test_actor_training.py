"""The policy loss, its gradient and optimizer steps through Megatron equal a plain single-process torch run.

The reference (tests/support/reference.py) runs the HF model one episode at a time with the algorithm's
loss over the whole batch and torch AdamW. Megatron runs several micro-batches per rank and splits the
batch across data-parallel ranks, so equality shows the loss is normalised by the global token count
(not averaged per micro-batch or per rank).
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.support import reference
from tests.support.distributed import build_actor, init_world, megatron_config, random_batch, spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import AlgoConfig
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

LENGTHS = [12, 30, 7, 22, 16, 9]
ALGOS = {
    # token-mean with every optional term: KL to a reference, entropy bonus, truncated IS, dual clip
    "token_mean": AlgoConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, clip_high=0.28),
    "seq_mean_token_mean": AlgoConfig(loss_agg="seq-mean-token-mean"),
}
LAYOUTS = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "dp2": {"use_distributed_optimizer": False},
    "dp2_overlap": {"use_distributed_optimizer": False, "overlap_grad_reduce": True},
    # recompute changes what is stored, never the gradient
    "tp2_selective": {"tp": 2, "recompute": "selective"},
    "pp2_full_block": {"pp": 2, "recompute": "full", "recompute_num_layers": 1},
}
# fp32 flash attention (torch SDPA, on both sides) is accurate to ~1e-6 relative: identical inputs give
# identical outputs (TP=1 agrees to 5e-8), but TP's differently ordered sums upstream move the gradients by
# ~3e-5 of their scale. A normalisation or mapping error moves them by orders of magnitude more.
GRAD_RTOL = 1e-4


def with_reference_terms(batch: TrainBatch, seed: int) -> TrainBatch:
    """Add reference and rollout log-probs near the old ones."""
    gen = torch.Generator().manual_seed(seed)

    def near(rows: list[list[float]]) -> list[list[float]]:
        return [[v + 0.2 * float(torch.randn(1, generator=gen)) for v in row] for row in rows]

    return dataclasses.replace(batch, ref_logprobs=near(batch.old_logprobs), rollout_logprobs=near(batch.old_logprobs))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("train") / "qwen2", seed=5)


def _gradients(rank: int, world: int, port: int, model_dir: Path, batch: TrainBatch, single: TrainBatch) -> dict:
    """Loss and HF-named gradients (of this rank's pipeline stage) after one forward/backward, per case."""
    from userrl_megatron.megatron.export import export_hf

    out = {}
    for layout_name, layout in LAYOUTS.items():
        cfg = megatron_config(micro_batch_tokens=32, **layout)
        init_world(rank, world, port, cfg)
        for algo_name, algo in ALGOS.items():
            actor = build_actor(model_dir, cfg, algo)
            for batch_name, b in (("batch", batch), ("single", single)):
                outputs = actor._accumulate_gradients(b)
                loss = actor._reduce_metrics(outputs, rollout=b.rollout_logprobs is not None)["actor/loss"]
                modules = [c.module for c in actor.chunks]
                grads = export_hf(modules, actor.converter, actor.layout, tensor_of=lambda p: p.main_grad)
                out[(layout_name, algo_name, batch_name)] = (loss, {k: v.numpy().copy() for k, v in grads})
    return out


def test_loss_and_gradient_equal_the_torch_reference(model_dir: Path) -> None:
    batch = with_reference_terms(random_batch(256, LENGTHS, seed=11), seed=12)
    single = with_reference_terms(random_batch(256, [20], seed=13), seed=14)  # DP2: one rank gets nothing
    results = spawn(_gradients, 2, model_dir, batch, single)
    for algo_name, algo in ALGOS.items():
        for batch_name, b in (("batch", batch), ("single", single)):
            ref_loss, ref_grads = reference.gradients(model_dir, b, algo)
            for layout in LAYOUTS:
                key = (layout, algo_name, batch_name)
                loss = results[0][key][0]
                grads = {**results[1][key][1], **results[0][key][1]}  # PP: each stage exports its own
                assert abs(loss - ref_loss) <= 1e-6, (key, loss, ref_loss)
                assert grads.keys() == ref_grads.keys(), key
                worst = max(float((torch.from_numpy(grads[k]) - ref_grads[k]).abs().max()) for k in grads)
                scale = max(float(g.abs().max()) for g in ref_grads.values())
                assert worst <= GRAD_RTOL * scale, (key, worst, scale)


def _steps(rank: int, world: int, port: int, runs: dict, batches: list[TrainBatch], algo: AlgoConfig) -> dict:
    """`runs`: name -> (model dir, layout); the metrics of every step of each run."""
    out = {}
    for name, (model_dir, layout) in runs.items():
        cfg = megatron_config(micro_batch_tokens=32, **layout, **SCHEDULE)
        init_world(rank, world, port, cfg)
        actor = build_actor(model_dir, cfg, algo)
        out[name] = [actor.train_step(b) for b in batches]
    return out


# With megatron_config's adam_eps (1e-6, above the flash-attention noise under TP, see GRAD_RTOL) the
# measured loss differences stay <= 2e-6 under TP2 and ~1e-7 under the other layouts.
SCHEDULE = {"lr_warmup_steps": 2, "lr_schedule": "cosine", "lr_decay_steps": 5, "grad_clip": 0.5, "lr": 2e-3}


def test_optimizer_steps_equal_the_torch_reference_under_every_layout(model_dir: Path, tmp_path: Path) -> None:
    algo = AlgoConfig(entropy_coef=0.01)
    batches = [random_batch(250, LENGTHS, seed=s) for s in range(3)]
    # a tied, vocabulary-padded Llama under PP: the embedding's gradient is summed over both stages' copies
    tied = make_tiny_model("llama", tmp_path / "llama", seed=4, tie_word_embeddings=True, vocab_size=250)
    extra = {"dp2_distopt": {}, "dp2_distopt_overlap": {"overlap_grad_reduce": True}}
    runs = {name: (model_dir, layout) for name, layout in {**LAYOUTS, **extra}.items()}
    runs["tied_pp2"] = (tied, {"pp": 2})
    expected = {path: reference.train(path, batches, algo, megatron_config(**SCHEDULE)) for path in (model_dir, tied)}
    results = spawn(_steps, 2, runs, batches, algo)
    for layout, steps in results[0].items():
        assert steps == results[1][layout]  # identical on every rank
        for step, (got, want) in enumerate(zip(steps, expected[runs[layout][0]], strict=True)):
            assert abs(got["actor/loss"] - want["loss"]) <= 1e-5, (layout, step, got["actor/loss"], want["loss"])
            assert got["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_RTOL), (layout, step)
            assert got["actor/lr"] == pytest.approx(want["lr"], rel=1e-12)
    first = results[0]["tp2"][0]
    assert first["actor/trained_tokens"] == sum(sum(m) for m in batches[0].loss_mask)
    assert first["actor/tokens"] == sum(LENGTHS) and first["actor/steps"] == 1.0
    assert 0.0 <= first["actor/clip_frac"] <= 1.0 and first["actor/entropy"] > 0
    assert first["actor/grad_norm"] > SCHEDULE["grad_clip"]  # clipping was exercised


def _bad_batches(rank: int, world: int, port: int, model_dir: Path, cases: dict[str, TrainBatch]) -> dict[str, str]:
    cfg = megatron_config(micro_batch_tokens=32)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg, AlgoConfig(kl_coef=0.1))
    messages = {}
    for name, batch in cases.items():
        try:
            actor.train_step(batch)
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_bad_batches_get_clear_errors(model_dir: Path) -> None:
    good = random_batch(256, [10, 8], seed=1)
    good = dataclasses.replace(good, ref_logprobs=good.old_logprobs)
    cases = {
        "short_mask": dataclasses.replace(good, loss_mask=[good.loss_mask[0], good.loss_mask[1][:-1]]),
        "first_trained": dataclasses.replace(good, loss_mask=[[1, *good.loss_mask[0][1:]], good.loss_mask[1]]),
        "bad_id": dataclasses.replace(good, token_ids=[good.token_ids[0], [300, *good.token_ids[1][1:]]]),
        "too_long": random_batch(256, [40], seed=2),
        "no_ref": dataclasses.replace(good, ref_logprobs=None),
    }
    cases["too_long"] = dataclasses.replace(cases["too_long"], ref_logprobs=cases["too_long"].old_logprobs)
    messages = spawn(_bad_batches, 1, model_dir, cases)[0]
    assert messages == {
        "short_mask": "TrainBatch.loss_mask[1] has 7 values for 8 tokens",
        "first_trained": "TrainBatch.loss_mask[0][0] is 1: the first token has no context to be scored",
        "bad_id": "TrainBatch.token_ids[1] holds ids outside [0, 256): min "
        + str(min(cases["bad_id"].token_ids[1]))
        + ", max 300",
        "too_long": "episode 0 has 40 tokens, more than megatron.micro_batch_tokens = 32",
        "no_ref": "algo.kl_coef > 0 needs TrainBatch.ref_logprobs",
    }
