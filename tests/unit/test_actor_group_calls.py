"""How `ActorGroup` runs a `MegatronActor` method on its ranks: it hands the method itself to each rank's Ray actor
(`MegatronWorker.run`), which calls it on the rank's actor and ships back rank 0's answer only."""

from types import SimpleNamespace

import pytest
from ray import cloudpickle

from userrl_megatron.actors.workers import MegatronWorker
from userrl_megatron.megatron.actor import MegatronActor

METHODS = ["compute_logprobs", "train_step", "save", "finish_save", "load", "load_weights", "offload", "onload",
           "offloaded", "export_hf_dir"]  # fmt: skip


@pytest.mark.parametrize("name", METHODS)
def test_a_method_crosses_to_the_rank_by_reference(name: str) -> None:
    """The payload names the method (module and qualified name); the rank imports it, no code travels."""
    method = getattr(MegatronActor, name)
    payload = cloudpickle.dumps(method)
    assert cloudpickle.loads(payload) is method
    assert len(payload) < 200 and b"MegatronActor." + name.encode() in payload


def test_run_calls_the_method_on_the_ranks_actor_and_answers_on_rank_0_only() -> None:
    actor = SimpleNamespace(parking=SimpleNamespace(kinds={"weights", "grads"}))
    ranks = []
    for rank in (0, 1):
        worker = object.__new__(MegatronWorker)  # a rank as `setup` leaves it, without Ray or Megatron
        worker.rank, worker.actor = rank, actor
        ranks.append(worker)
    assert [w.run(MegatronActor.offloaded) for w in ranks] == [["grads", "weights"], None]
