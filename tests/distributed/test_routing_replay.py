"""Rollout routing replay on gloo: a trainer whose MoE routers disagree with the engine's (router weights
perturbed) reproduces the engine's log-probs to fp32 noise when it replays the engine's expert choices, in the
log-prob forward and in the training forward, at DP2 and at EP2; without replay the mismatch shows.

The engine side is the embedded engine's model (transformers, `EngineModel.forward(routing=True)`) on the
unperturbed weights: its routing of positions 0 … n − 2 (what `/generate` returns) and its log-probs.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.distributed import (
    build_actor,
    hf_logprobs,
    init_world,
    max_abs_diff,
    megatron_config,
    random_sequences,
    spawn,
)
from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from userrl_megatron.config.schema import AlgoConfig
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

LENGTHS = [17, 9, 30, 5]
# Experts 0 and 1 get near-tied router rows, w1 = w0 ± EPS·r: the engine's and the trainer's routers (+ and −)
# pick different ones of the two wherever they compete for the last top-k slot, while their gate weights differ
# by O(EPS) only, as under numerical differences between an engine's and a trainer's kernels.
EPS = 1e-5
LAYOUTS = [("dp2", {}), ("ep2", {"expert_model_parallel_size": 2})]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("replay")
    gen = torch.Generator().manual_seed(7)
    dirs = {}
    for side, sign in (("engine", 1.0), ("trainer", -1.0)):
        dirs[side] = make_tiny_model(MOE_FAMILY, root / side, seed=3)
        weights = load_file(dirs[side] / "model.safetensors")
        for name, w in weights.items():
            if name.endswith("mlp.gate.weight"):
                gen.manual_seed(7)  # the same direction r on both sides
                w[1] = w[0] + sign * EPS * w.std() * torch.randn(w.shape[1], generator=gen)
        save_file(weights, dirs[side] / "model.safetensors", metadata={"format": "pt"})
    engine_dir, trainer_dir = dirs["engine"], dirs["trainer"]
    seqs = random_sequences(256, LENGTHS, seed=1)
    return {
        "engine": engine_dir,
        "trainer": trainer_dir,
        "seqs": seqs,
        "engine_routing": [engine_routing(engine_dir, s)[:-1] for s in seqs],  # /generate's rows: all but the last
        "trainer_routing": [engine_routing(trainer_dir, s)[:-1] for s in seqs],
        "engine_logprobs": hf_logprobs(engine_dir, seqs),
    }


def engine_routing(model_dir: Path, seq: list[int]) -> np.ndarray:
    """int32 [len(seq), layers x top_k]: the experts the embedded engine's routers choose for each position."""
    from userrl_megatron.server.model import EngineModel

    model = EngineModel(model_dir)
    _, routed = model.forward(torch.tensor([seq]), torch.arange(len(seq))[None], None, routing=True)
    return routed[0].reshape(len(seq), -1).numpy()


def _replay(rank: int, world: int, port: int, model_dir: str, seqs: list, routed: list, engine_lp: list) -> dict:
    out = {}
    mask = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    adv = [[0.5 if m else 0.0 for m in row] for row in mask]
    for name, overrides in LAYOUTS:
        cfg = megatron_config(devices_per_node=world, moe_aux_loss_coef=0.0, micro_batch_tokens=40, **overrides)
        init_world(rank, world, port, cfg)
        actor = build_actor(Path(model_dir), cfg, AlgoConfig(routing_replay="rollout"))
        replayed = actor.compute_logprobs(TrainBatch(seqs, [], [], routed_experts=routed))
        own = actor.compute_logprobs(TrainBatch(seqs, [], []))
        # training forward with replay, old log-probs = the engine's: the PPO ratio is 1 up to fp32 noise
        step = actor.train_step(
            TrainBatch(seqs, mask, adv, old_logprobs=engine_lp, rollout_logprobs=engine_lp, routed_experts=routed)
        )
        out[name] = {"replayed": replayed, "own": own, "step": step}
    return out


def _no_replay_step(rank: int, world: int, port: int, model_dir: str, seqs: list, engine_lp: list) -> dict:
    mask = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    adv = [[0.5 if m else 0.0 for m in row] for row in mask]
    cfg = megatron_config(devices_per_node=world, moe_aux_loss_coef=0.0, micro_batch_tokens=40)
    init_world(rank, world, port, cfg)
    actor = build_actor(Path(model_dir), cfg)
    old = actor.compute_logprobs(TrainBatch(seqs, [], []))
    return actor.train_step(TrainBatch(seqs, mask, adv, old_logprobs=old, rollout_logprobs=engine_lp))


def test_replay_reproduces_the_engines_logprobs_when_routers_disagree(models: dict) -> None:
    pairs = zip(models["engine_routing"], models["trainer_routing"], strict=True)
    disagree = sum(int((a != b).any(axis=1).sum()) for a, b in pairs)
    assert disagree >= 10  # measured: 47 of the 61 positions differ in some layer
    trainer_own = hf_logprobs(models["trainer"], models["seqs"])
    engine_lp = models["engine_logprobs"]
    assert max_abs_diff(trainer_own, engine_lp) > 1e-3  # so the plain log-probs differ (measured 6.8e-3)

    args = (str(models["trainer"]), models["seqs"], models["engine_routing"], engine_lp)
    results = spawn(_replay, 2, *args)
    for rank_result in results:
        for name, _ in LAYOUTS:
            got = rank_result[name]
            assert max_abs_diff(got["replayed"], engine_lp) <= 1e-5, name  # measured 9.5e-7 (fp32 noise)
            assert max_abs_diff(got["own"], trainer_own) <= 1e-5, name  # no routing given: the router's own
            step = got["step"]
            assert step["actor/ppo_kl"] <= 1e-10, name  # training forward replayed too: log-probs = old
            assert step["actor/ratio"] == pytest.approx(1.0, abs=1e-5), name
            assert step["mismatch/abs_logprob_diff"] == 0.0, name

    # without replay the trainer's old log-probs are its own: the mismatch metric shows the routers' disagreement
    step = spawn(_no_replay_step, 2, str(models["trainer"]), models["seqs"], engine_lp)[0]
    assert step["mismatch/abs_logprob_diff"] > 1e-4  # measured 1.3e-3 (mean over trained tokens)


def test_replay_is_refused_for_a_dense_model(tmp_path: Path) -> None:
    dense = make_tiny_model("qwen3", tmp_path / "dense")
    err = spawn(_dense, 1, str(dense))[0]
    assert err == "algo.routing_replay = rollout needs a mixture-of-experts model; qwen3 is dense (set it to none)"


def _dense(rank: int, world: int, port: int, model_dir: str) -> str:
    from userrl_megatron.config.loader import ConfigError

    cfg = megatron_config(devices_per_node=world)
    init_world(rank, world, port, cfg)
    try:
        build_actor(Path(model_dir), cfg, AlgoConfig(routing_replay="rollout"))
    except ConfigError as e:
        return str(e)
    return "accepted"
