"""The pinned setup works inside Ray actors, one per rank: TP=2 log-probs and a train step through Ray."""

from pathlib import Path

import pytest

from tests.support.distributed import hf_logprobs, max_abs_diff, random_batch
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.ports import free_port
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 1800.0  # the ranks start, build their actors and compute: only a hang takes longer


class Rank:
    """One actor rank: `parallel.initialize` then `MegatronActor`, as the trainer's Ray workers do."""

    def __init__(self, rank: int, world_size: int, port: int, model_dir: str) -> None:
        from tests.support.distributed import build_actor, init_world, megatron_config

        cfg = megatron_config(tp=2, micro_batch_tokens=32)
        init_world(rank, world_size, port, cfg)
        self.actor = build_actor(Path(model_dir), cfg)

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self.actor.compute_logprobs(batch)

    def train(self, batch: TrainBatch) -> float:
        return self.actor.train_step(batch)["actor/loss"]


def test_two_ray_actors_run_tensor_parallel(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=6)
    batch = random_batch(256, [9, 17, 5], seed=3)
    expected = hf_logprobs(model_dir, batch.token_ids)
    ray.init(
        address="local",  # never a cluster already on the machine
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    try:
        remote = ray.remote(num_cpus=1)(Rank)
        port = free_port()
        ranks = [remote.remote(r, 2, port, str(model_dir)) for r in range(2)]
        logprobs = ray.get([r.logprobs.remote(batch) for r in ranks], timeout=DEADLINE_S)
        losses = ray.get([r.train.remote(batch) for r in ranks], timeout=DEADLINE_S)
    finally:
        ray.shutdown()
    assert logprobs[0] == logprobs[1]
    assert max_abs_diff(logprobs[0], expected) <= 1e-5
    assert losses[0] == losses[1]
