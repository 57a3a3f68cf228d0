"""The engines' and the actor's turns on shared GPUs (colocated mode), and bringing dead engines back.

Colocated, the actor and the engines share every GPU: entering training, the engines pause and release their
memory (`MEMORY_TAGS`) and, with `megatron.offload`, the actor's state returns from host memory; entering the
rollout, the reverse. Each release pairs with exactly one resume. Disaggregated, every hand-off is a no-op.

A weight push (`WeightSync`) runs inside this order: `before_push` (the actor's grads and optimizer state leave),
`open_for_push` (the engines' weight memory comes back), `close_after_push`; a restarted engine's repair brings the
actor's parked weights back for it (`actor_weights_for_repair`) and releases what the others have released
(`match_released`). `WeightSync` holds no memory order of its own.

Released weights come back empty unless the engines keep a host copy (SGLang's `--enable-weights-cpu-backup`,
forced on when sync is off): a resume maps fresh memory. So weights never come back without a push: the weight
sync resumes them and pushes, and a hand-off back to the rollout that finds them still released pushes the
current weights first (`refill`).

The user simulator's engines on the same GPUs (`user_sim.engines.placement: policy_engines`, the `shared` pool)
take the same turns: paused (which also stops their generation probes) and their KV cache and CUDA graphs released
(`FROZEN_MEMORY_TAGS`) while the actor trains, resumed before the rollout. They keep their weights: a frozen model
gets no weight sync to restore them, and SGLang's release of weights without a host backup loses them.

`metrics()` counts the hand-offs of the run so far, per pool: how often its engines released their memory and how
often they took all of it back (`rollout/memory_releases`, `rollout/memory_resumes`, and `user_sim/...` for the
shared pool), logged with every step.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from userrl_megatron.actors.protocol import Actors
from userrl_megatron.config.resolve import keeps_weights
from userrl_megatron.config.schema import RootConfig
from userrl_megatron.errors import RunError
from userrl_megatron.trainer.seams import EngineClient, EnginePool

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # what colocated engines release while the actor trains
FROZEN_MEMORY_TAGS = ("kv_cache", "cuda_graph")  # what the simulator's engines on those GPUs release: no state


def check_engines(cfg: RootConfig, pool: EnginePool, whose: str = "rollout") -> None:
    """No engine left (each given up after its restarts) stops the run."""
    if pool.exhausted:
        raise RunError(
            f"every {whose} engine failed and was given up after {cfg.rollout.engine_max_restarts} "
            f"restarts; engine logs: {pool.log_dir}"
        )


async def repair_engines(cfg: RootConfig, pool: EnginePool, what: str, whose: str = "rollout") -> None:
    """Restart the engines that died and wait until each is back (or given up); `whose` names them in the error
    ("rollout": the policy's)."""
    try:
        await pool.repair(cfg.rollout.engine_restart_timeout_s)
    except Exception as e:
        check_engines(cfg, pool, whose)
        raise RunError(f"{what}: the {whose} engines could not be brought back ({e})") from e


class MemoryHandoff:
    """Who holds the GPUs' memory: the engines (rollout) or the actor (training)."""

    def __init__(self, cfg: RootConfig, actors: Actors, pool: EnginePool, shared: EnginePool | None = None) -> None:
        self.cfg, self.actors, self.pool = cfg, actors, pool
        self.shared = shared  # the user simulator's engines on the policy engines' GPUs (None: none there)
        self.colocated = cfg.rollout.colocate
        self.keeps_weights = keeps_weights(cfg.rollout)
        self.refill: Callable[[], Awaitable[Any]] | None = None  # pushes the current weights (`WeightSync`)
        self.released: set[str] = set()  # engine memory tags released and not resumed yet
        self.shared_released = False  # the shared engines' FROZEN_MEMORY_TAGS released and not resumed yet
        # The run's hand-offs so far: releases of memory the engines held, and resumes that gave all of it back.
        self.releases = self.resumes = self.shared_releases = self.shared_resumes = 0
        if shared is not None:
            shared.add_restart_hook(self._shared_restarted)

    async def enter_training(self) -> None:
        """Colocated mode: the engines pause and free their GPU memory; with `megatron.offload` the actor's state
        returns to the GPU."""
        if self.colocated:
            await repair_engines(self.cfg, self.pool, "entering training")  # a restarting engine cannot release
            await self.pool.pause()  # also stops health probes: a released engine holds generation
            await self.release(MEMORY_TAGS)
            await self._release_shared()
            if self.cfg.megatron.offload:
                await asyncio.to_thread(self.actors.onload)

    async def enter_rollout(self) -> None:
        """Colocated mode: with `megatron.offload` the actor's state goes to host memory; the engines take their
        memory back and resume."""
        if self.colocated:
            if "weights" in self.released and not self.keeps_weights:
                await self._refill()  # before the actor's weights leave: the push exports them
            if self.cfg.megatron.offload:
                await asyncio.to_thread(self.actors.offload)
            await self.resume(MEMORY_TAGS)
            await self.pool.resume()
            await self._resume_shared()

    @contextlib.asynccontextmanager
    async def actor_on_device(self) -> AsyncIterator[None]:
        """Colocated: a checkpoint save or an HF export outside the training window reads the actor's state, which
        is offloaded while the engines hold their memory: the engines step aside for it, then take their memory
        back (their weights refilled by a push)."""
        if not self.colocated:
            yield
            return
        await self.enter_training()
        try:
            yield
        finally:
            await self.enter_rollout()

    # ---- around a weight push (`WeightSync`) ----

    async def before_push(self) -> None:
        """Colocated with `megatron.offload`: the actor's grads and optimizer state leave the GPUs before the push,
        and before a dead engine restarts (it sizes its KV cache from the memory free at its start, for life)."""
        if self.colocated and self.cfg.megatron.offload:
            await asyncio.to_thread(self.actors.offload, False)

    async def open_for_push(self) -> None:
        """The engines stop generating and can take weights. Colocated, the pool is already paused
        (`enter_training`) and only their weight memory comes back: their KV cache returns in `enter_rollout`,
        after the actor's weights have moved out too. Disaggregated, the pool pauses."""
        if self.colocated:
            await self.resume(["weights"])
        else:
            await self.pool.pause()

    async def close_after_push(self) -> None:
        """Disaggregated: the engines generate again (colocated, they do in `enter_rollout`)."""
        if not self.colocated:
            await self.pool.resume()

    @contextlib.asynccontextmanager
    async def actor_weights_for_repair(self) -> AsyncIterator[None]:
        """A restarted engine gets the current weights. Restarted during a colocated rollout, the actor is
        offloaded: its weights alone come back for that push (the plan's rollout phase leaves room), then leave."""
        parked = "weights" in await asyncio.to_thread(self.actors.offloaded)
        if parked:
            await asyncio.to_thread(self.actors.onload, True)
        try:
            yield
        finally:
            if parked:
                await asyncio.to_thread(self.actors.offload)

    async def match_released(self, client: EngineClient) -> None:
        """A restarted engine releases what the other engines have released, so that the hand-off's resume pairs
        with a release on every engine."""
        if self.released:
            await client.release_memory(sorted(self.released))

    async def _refill(self) -> None:
        """Push the current weights into the engines' released weight memory (the push resumes it)."""
        if self.refill is None:
            raise RunError(
                "colocated engines released their weights without a host copy and nothing can push them back: "
                "enable sync, or the engines' enable_weights_cpu_backup"
            )
        await self.refill()
        if "weights" in self.released:
            raise RunError("the weight push left the engines' weight memory released")

    def metrics(self) -> dict[str, float]:
        """Colocated: the run's hand-offs so far, per pool (none disaggregated, where nothing steps aside)."""
        if not self.colocated:
            return {}
        out = {"rollout/memory_releases": float(self.releases), "rollout/memory_resumes": float(self.resumes)}
        if self.shared is not None:
            out["user_sim/memory_releases"] = float(self.shared_releases)
            out["user_sim/memory_resumes"] = float(self.shared_resumes)
        return out

    async def release(self, tags: Sequence[str]) -> None:
        """Release the tags not released yet; each release pairs with exactly one resume."""
        todo = [t for t in tags if t not in self.released]
        if todo:
            await self._each_engine(lambda c: c.release_memory(todo))
            if not self.released:  # a hand-off starts: the engines held all their memory
                self.releases += 1
            self.released.update(todo)

    async def resume(self, tags: Sequence[str]) -> None:
        """Resume only released tags: SGLang 0.5.23's scheduler dies (KeyError) resuming a tag it holds."""
        todo = [t for t in tags if t in self.released]
        if todo:
            await self._each_engine(lambda c: c.resume_memory(todo))
            self.released.difference_update(todo)
            if not self.released:  # the hand-off ends: the engines hold all their memory again
                self.resumes += 1

    async def _release_shared(self) -> None:
        """The simulator's engines on these GPUs: pause (no generation probe of a released engine), then release
        their KV cache and CUDA graphs; once until the next resume."""
        if self.shared is None or self.shared_released:
            return
        # a restarting engine cannot release
        await repair_engines(self.cfg, self.shared, "entering training", whose="user simulator")
        await self.shared.pause()
        await asyncio.gather(*(c.release_memory(list(FROZEN_MEMORY_TAGS)) for c in self.shared.clients))
        self.shared_released = True
        self.shared_releases += 1

    async def _resume_shared(self) -> None:
        if self.shared is None or not self.shared_released:
            return
        # An engine that died while released (its pool paused, so unprobed) is restarted here, and released again
        # by `_shared_restarted`: the resume below then finds every engine released, as SGLang requires.
        await repair_engines(self.cfg, self.shared, "leaving training", whose="user simulator")
        await asyncio.gather(*(c.resume_memory(list(FROZEN_MEMORY_TAGS)) for c in self.shared.clients))
        self.shared_released = False
        self.shared_resumes += 1
        await self.shared.resume()

    async def _shared_restarted(self, index: int, client: EngineClient) -> None:
        """The simulator pool's restart hook: inside a hand-off, release the fresh engine's memory, so that the
        hand-off's resume pairs with a release on every engine."""
        if self.shared_released:
            await client.release_memory(list(FROZEN_MEMORY_TAGS))

    async def _each_engine(self, call: Callable[[EngineClient], Awaitable[Any]]) -> None:
        await asyncio.gather(*(call(c) for c in self.pool.clients))
