"""The colocated hand-offs with the user simulator's engines on the policy engines' GPUs
(`user_sim.engines.placement: policy_engines`): `MemoryHandoff` pauses both pools and releases both engines' memory
while the actor trains, and gives both back before the rollout, the simulator keeping its weights. Fakes record
every call in one list, so the order is checked exactly."""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from userrl_megatron.config import RootConfig, load_config
from userrl_megatron.errors import RunError
from userrl_megatron.trainer.components import Components
from userrl_megatron.trainer.handoff import MemoryHandoff
from userrl_megatron.trainer.seams import EngineClient

COLOCATED = ["rollout.colocate=true", "megatron.offload=true", "rollout.num_engines=2", "rollout.backend=embedded"]
SHARED = ["user_sim.engines.model=m", "user_sim.engines.num_engines=2", "user_sim.engines.placement=policy_engines"]


class Client:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls
        self.base_url = f"http://{name}"

    async def release_memory(self, tags: list[str]) -> None:
        self.calls.append(f"{self.name} release {','.join(tags)}")

    async def resume_memory(self, tags: list[str]) -> None:
        self.calls.append(f"{self.name} resume {','.join(tags)}")

    async def get_weights_by_name(self, name: str, truncate_size: int = 0) -> None:
        return None

    async def destroy_weights_update_group(self, name: str) -> None:
        return None


class Pool:
    """An engine pool of two engines (`trainer.seams.EnginePool`), recording its pauses, resumes and repairs."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls
        self._clients = [Client(f"{name}{e}", calls) for e in range(2)]
        self.urls = [c.base_url for c in self._clients]
        self.api_key, self.concurrency, self.exhausted, self.restarts_total, self.log_dir = "", 1, False, 0, None
        self.restart_hooks: list[Callable[[int, Client], Awaitable[None]]] = []

    @property
    def clients(self) -> Sequence[EngineClient]:
        return self._clients

    def add_restart_hook(self, hook: Callable[[int, Client], Awaitable[None]]) -> None:
        self.restart_hooks.append(hook)

    async def restarted(self, index: int) -> None:
        """What `RolloutPool` does once engine `index` is back: every hook, in the order added."""
        for hook in self.restart_hooks:
            await hook(index, self._clients[index])

    def session(self, episode_id: str = "") -> None:
        return None

    async def start(self) -> None:
        self.calls.append(f"{self.name} start")

    async def pause(self, mode: str = "abort") -> None:
        self.calls.append(f"{self.name} pause")

    async def resume(self) -> None:
        self.calls.append(f"{self.name} resume")

    async def flush_cache(self) -> None:
        return None

    async def repair(self, timeout_s: float) -> None:
        self.calls.append(f"{self.name} repair")

    async def restart(self, urls: list[str], timeout_s: float) -> list[Any]:
        return []

    async def kill_engine_server(self, index: int) -> int:
        return -1


class Actors:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def offload(self, weights: bool = True) -> None:
        self.calls.append("actor offload")

    def onload(self, weights_only: bool = False) -> None:
        self.calls.append("actor onload")


def handoff(cfg: RootConfig, shared: bool = True) -> tuple[MemoryHandoff, list[str]]:
    calls: list[str] = []
    h = MemoryHandoff(cfg, Actors(calls), Pool("policy", calls), Pool("sim", calls) if shared else None)  # type: ignore[arg-type]
    return with_push(h, calls), calls


def with_push(h: MemoryHandoff, calls: list[str]) -> MemoryHandoff:
    """`h` refilling the released weights as `WeightSync.refill` does: a push, which resumes them first."""

    async def push() -> None:
        calls.append("push")
        await h.resume(["weights"])

    h.refill = push
    return h


def test_both_pools_step_aside_while_the_actor_trains_and_come_back_before_the_rollout() -> None:
    h, calls = handoff(load_config(overrides=[*COLOCATED, *SHARED]))

    async def step() -> None:
        await h.enter_training()
        await h.enter_training()  # already released: nothing is released twice
        await h.enter_rollout()
        await h.enter_rollout()  # already resumed: nothing is resumed twice

    asyncio.run(step())
    assert calls == [
        "policy repair",
        "policy pause",
        "policy0 release kv_cache,weights,cuda_graph",
        "policy1 release kv_cache,weights,cuda_graph",
        "sim repair",
        "sim pause",
        "sim0 release kv_cache,cuda_graph",  # a frozen model keeps its weights: no sync would restore them
        "sim1 release kv_cache,cuda_graph",
        "actor onload",
        # the second enter_training: the policy's pool is repaired and paused again, its memory already released
        "policy repair",
        "policy pause",
        "actor onload",
        "push",  # released weights come back empty: they come back only with a push, before the actor leaves
        "policy0 resume weights",
        "policy1 resume weights",
        "actor offload",
        "policy0 resume kv_cache,cuda_graph",
        "policy1 resume kv_cache,cuda_graph",
        "policy resume",
        "sim repair",  # an engine that died while released comes back before the resume (next test)
        "sim0 resume kv_cache,cuda_graph",
        "sim1 resume kv_cache,cuda_graph",
        "sim resume",
        "actor offload",  # the second enter_rollout: nothing of either pool was released
        "policy resume",
    ]
    assert h.released == set() and not h.shared_released
    assert h.metrics() == {  # one hand-off each way per pool, whatever was asked twice
        "rollout/memory_releases": 1.0,
        "rollout/memory_resumes": 1.0,
        "user_sim/memory_releases": 1.0,
        "user_sim/memory_resumes": 1.0,
    }


def test_a_hand_off_ends_when_all_the_memory_is_back() -> None:
    """The weight sync takes the policy engines' weights back first, their KV cache and CUDA graphs come back in
    enter_rollout: one resume of the hand-off, counted when nothing is left released."""
    h, _ = handoff(load_config(overrides=COLOCATED), shared=False)

    async def step() -> list[dict[str, float]]:
        await h.enter_training()
        seen = [h.metrics()]
        await h.resume(["weights"])
        seen.append(h.metrics())
        await h.enter_rollout()
        return [*seen, h.metrics()]

    assert [(m["rollout/memory_releases"], m["rollout/memory_resumes"]) for m in asyncio.run(step())] == [
        (1.0, 0.0),
        (1.0, 0.0),
        (1.0, 1.0),
    ]
    assert "user_sim/memory_releases" not in h.metrics()  # no simulator engines on these GPUs


@pytest.mark.parametrize("client_first", [True, False], ids=["client-hook-first", "handoff-hook-first"])
def test_a_simulator_engine_that_died_while_released_comes_back_released_and_is_resumed(client_first: bool) -> None:
    """Its pool is paused while the actor trains, so the death is found by the repair before the resume; the
    restarted engine holds its memory, so it is released again and the resume that ends the hand-off pairs with a
    release on every engine. The simulator client's own hook (following the engine's new address) still runs,
    whichever of the two was added to the pool first."""
    calls: list[str] = []
    sim = Pool("sim", calls)

    async def follow(index: int, client: Client) -> None:
        calls.append(f"follow {index} to {client.base_url}")

    if client_first:
        sim.add_restart_hook(follow)
    h = MemoryHandoff(load_config(overrides=[*COLOCATED, *SHARED]), Actors(calls), Pool("policy", calls), sim)  # type: ignore[arg-type]
    with_push(h, calls)
    if not client_first:
        sim.add_restart_hook(follow)

    async def restarting(timeout_s: float) -> None:
        calls.append("sim repair")
        sim._clients[1] = Client("sim1-new", calls)
        await sim.restarted(1)

    asyncio.run(h.enter_training())
    sim.repair = restarting  # type: ignore[method-assign]
    del calls[:]
    asyncio.run(h.enter_rollout())
    hooks = ["follow 1 to http://sim1-new", "sim1-new release kv_cache,cuda_graph"]
    assert calls[calls.index("sim repair") :] == [
        "sim repair",
        *(hooks if client_first else hooks[::-1]),
        "sim0 resume kv_cache,cuda_graph",
        "sim1-new resume kv_cache,cuda_graph",
        "sim resume",
    ]
    assert h.metrics()["user_sim/memory_resumes"] == 1.0


def test_checkpoint_saves_make_room_the_same_way() -> None:
    h, calls = handoff(load_config(overrides=[*COLOCATED, *SHARED]))

    async def save() -> None:
        async with h.actor_on_device():
            calls.append("save")

    asyncio.run(save())
    at = calls.index("save")
    assert "sim0 release kv_cache,cuda_graph" in calls[:at] and calls[at + 1 :][-3:] == [
        "sim0 resume kv_cache,cuda_graph",
        "sim1 resume kv_cache,cuda_graph",
        "sim resume",
    ]


def test_a_simulator_pool_with_no_engine_left_stops_the_run_by_its_name() -> None:
    h, calls = handoff(load_config(overrides=[*COLOCATED, *SHARED]))
    assert h.shared is not None

    async def gone(timeout_s: float) -> None:
        raise RuntimeError("every engine was given up")

    h.shared.repair = gone  # type: ignore[method-assign]
    h.shared.exhausted = True  # type: ignore[misc]
    with pytest.raises(RunError, match=r"^every user simulator engine failed and was given up after 3 restarts"):
        asyncio.run(h.enter_training())
    assert "sim pause" not in calls  # nothing released on a pool that is gone


def test_disaggregated_nothing_steps_aside() -> None:
    h, calls = handoff(load_config(overrides=[*COLOCATED[1:], *SHARED]))
    asyncio.run(h.enter_training())
    asyncio.run(h.enter_rollout())
    assert calls == [] and h.metrics() == {}


def test_components_hand_the_simulators_pool_over_only_when_it_shares_the_gpus() -> None:
    calls: list[str] = []
    sim = Pool("sim", calls)

    def parts(*overrides: str) -> Components:
        cfg = load_config(overrides=[*COLOCATED, *overrides])
        return Components(cfg, Actors(calls), Pool("policy", calls), None, None, [], sim_pool=sim)  # type: ignore[arg-type]

    assert parts(*SHARED).handoff.shared is sim
    assert parts("user_sim.engines.model=m").handoff.shared is None  # GPUs of their own: never paused or released


def test_each_side_is_launched_counting_the_share_the_other_holds() -> None:
    """SGLang sizes its KV pool from what is free at its start less (1 - fraction) of the GPU: the policy's engines
    (started after the simulator's) and a restarted simulator engine (the policy's engine beside it) are launched
    with both shares; a simulator engine's first start with its own."""
    from userrl_megatron.fleet.pool import RolloutPool
    from userrl_megatron.fleet.simulator import policy_engine_rollout, simulator_restart_rollout, simulator_rollout

    fractions = ["rollout.sglang.mem_fraction_static=0.45", "user_sim.engines.mem_fraction_static=0.35"]
    cfg = load_config(overrides=["rollout.backend=sglang", "rollout.num_engines=2", *SHARED, *fractions])
    restart = simulator_restart_rollout(cfg)
    assert restart is not None and restart.sglang.mem_fraction_static == 0.8
    assert simulator_rollout(cfg).sglang.mem_fraction_static == 0.35
    assert policy_engine_rollout(cfg).sglang.mem_fraction_static == 0.8
    pool = RolloutPool(simulator_rollout(cfg), "m", restart_cfg=restart)
    assert pool._launch(1).sglang.mem_fraction_static == 0.35
    assert pool._launch(1, restarted=True).sglang.mem_fraction_static == 0.8
    assert pool._launch(1, restarted=True).port == pool._launch(1).port
    own = load_config(overrides=["rollout.backend=sglang", "user_sim.engines.model=m", *fractions])
    assert simulator_restart_rollout(own) is None and policy_engine_rollout(own) is own.rollout
    embedded = load_config(overrides=["rollout.backend=embedded", "rollout.num_engines=2", *SHARED, *fractions])
    assert simulator_restart_rollout(embedded) is None and policy_engine_rollout(embedded) is embedded.rollout


def test_released_weights_come_back_only_with_a_push() -> None:
    """Without a host copy the engines' weights come back empty (SGLang 0.5.23's resume maps fresh memory,
    `managers/scheduler_components/weight_updater.py:395-403`): handing the GPUs back with the weights still
    released pushes first, and without a way to push the hand-off refuses; with a host copy nothing is pushed."""
    calls: list[str] = []
    h = MemoryHandoff(load_config(overrides=COLOCATED), Actors(calls), Pool("policy", calls))  # type: ignore[arg-type]
    asyncio.run(h.enter_training())
    with pytest.raises(RunError, match=r"^colocated engines released their weights without a host copy and nothing"):
        asyncio.run(h.enter_rollout())
    assert not any("resume" in c for c in calls)  # no engine got its weight memory back empty

    kept = ["rollout.embedded.enable_weights_cpu_backup=true"]
    h, calls = handoff(load_config(overrides=[*COLOCATED, *kept]), shared=False)
    asyncio.run(h.enter_training())
    asyncio.run(h.enter_rollout())
    assert "push" not in calls and "policy0 resume kv_cache,weights,cuda_graph" in calls
