"""How the rollout pool reads a failed call to an engine's Ray actor: every way Ray reports the actor's process as
gone (dead, killed by Ray's out-of-memory monitor, its worker crashed, its node lost) is that engine's death, so it
is restarted with a new actor; anything else is not swallowed."""

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, NodeDiedError, OutOfMemoryError, WorkerCrashedError

from userrl_megatron.config.schema import RolloutConfig
from userrl_megatron.fleet.pool import Engine, RolloutPool


class _Method:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def remote(self) -> Any:
        raise self.error


class _GoneActor:
    """An engine actor whose every call fails with `error`, as Ray raises it for a process that is gone."""

    def __init__(self, error: BaseException) -> None:
        self.alive = _Method(error)


@pytest.mark.parametrize(
    "error",
    [
        ActorDiedError(),
        OutOfMemoryError("Memory on the node was 22.39GB used / 23.54GB limit"),
        WorkerCrashedError(),
        NodeDiedError("node lost"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_engine_whose_actor_is_gone_is_dead(error: BaseException) -> None:
    pool = RolloutPool(RolloutConfig(), "m")
    engine = Engine(0, _GoneActor(error), url="http://127.0.0.1:1")
    assert asyncio.run(pool._liveness_problem(engine)) == f"its Ray actor died ({type(error).__name__})"


def test_another_error_of_the_actor_is_not_read_as_its_death() -> None:
    pool = RolloutPool(RolloutConfig(), "m")
    engine = Engine(0, _GoneActor(ValueError("a bug in the actor")), url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="a bug in the actor"):
        asyncio.run(pool._liveness_problem(engine))
