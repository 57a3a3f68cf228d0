"""The rollout pool: Ray actors that each own one engine server, and routing of episodes onto them.

Each `EngineServer` actor sits on its placement-group bundle and launches one server process (`userrl serve`
or SGLang, the same launch path); the driver talks to the servers directly over HTTP (`SGLangClient`). An
episode's first request goes to the engine with the fewest outstanding requests and every later turn follows
it (its prefix stays in that engine's cache). Health tells slow from dead: an engine is dead when its process
is gone or its server stops answering, and wedged when it answers but has shown no progress (no request
finished, no generation probe passed) for `rollout.engine_stall_timeout_s`; a merely slow engine is left alone.
A dead or wedged engine is restarted in the background (a periodic health check catches silent deaths), the
requests it held are sent again elsewhere (or to it once it is back), and restart hooks (`add_restart_hook`, run
in the order added) let the trainer push current weights into it before it serves again. When every engine is
given up the pool is `exhausted`: requests fail at once and the trainer stops the run. `pause`/`resume` bracket
weight updates: requests aborted by the pause are sent again after `resume`.
"""

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import NodeDiedError, OutOfMemoryError, RayActorError, WorkerCrashedError

from userrl_megatron.config.schema import EmbeddedServerConfig, RolloutConfig, SGLangConfig
from userrl_megatron.cores import core_count
from userrl_megatron.fleet.auth import DEFAULT_KEY_ENV, run_api_key
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.engine_ports import BOOK, PortBlock
from userrl_megatron.fleet.launch import ProcessLaunch
from userrl_megatron.observability.progress import HEARTBEAT_S, heartbeat
from userrl_megatron.ports import free_port
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError, Generation

log = logging.getLogger(__name__)
# What a call to an engine's actor raises once its process is gone: dead, killed by Ray's out-of-memory monitor (the
# node's memory is shared with whatever else runs there), its worker crashed, or its node lost.
ACTOR_GONE = (RayActorError, OutOfMemoryError, WorkerCrashedError, NodeDiedError)

RestartHook = Callable[[int, SGLangClient], Awaitable[None]]  # (engine index, its new client)


def served_model_name(model_path: str) -> str:
    """The name every engine of a pool serves its model under (`--served-model-name`): the checkpoint directory's
    name, never its path. sglang-router 0.3.2 lists it on `/v1/models` to callers without the key."""
    return Path(model_path).name or "model"


@dataclass
class EngineLaunch:
    """How an `EngineServer` starts its server process."""

    backend: str  # "embedded" or "sglang"
    model_path: str
    dtype: str
    port: int  # 0: any free port (picked at each start)
    tp: int = 1
    embedded: EmbeddedServerConfig = field(default_factory=EmbeddedServerConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    log_path: str = ""
    index: int = 0  # the engine's index in the pool
    gpus: list[str] = field(default_factory=list)  # this process's GPU ids on its node (placement slots); []: none
    colocated: bool = False  # shares its GPUs with actor ranks (SGLang's memory saver)
    nnodes: int = 1  # nodes the engine spans (SGLang --nnodes)
    node_rank: int = 0  # this process's node (0 serves HTTP and starts the others)
    followers: list[tuple[dict[str, Any], "EngineLaunch"]] = field(default_factory=list)  # Ray options, launch
    dry: bool = False  # record what would run instead of running it (`trainer/dry_run.py`)
    api_key: str = field(default="", repr=False)  # the key the server requires ("" = none), in its environment
    api_key_env: str = DEFAULT_KEY_ENV  # the environment variable that hands the key over
    ports: PortBlock | None = None  # the engine's own ports on each of its nodes (`fleet/engine_ports.py`); None: any


@dataclass(frozen=True)
class EngineProcess:
    """What one engine process runs, where: the record of a dry start (`EngineLaunch.dry`)."""

    engine: int
    node_rank: int
    ip: str  # the node it runs on
    launch: ProcessLaunch


class EngineServer:
    """Ray actor owning one engine server process: start, restart, stop, liveness, log.

    An engine wider than a node has one `EngineServer` per node: node rank 0's creates the others (its
    followers), starts them first and serves HTTP; they stop and restart together."""

    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        self.server: Any = None  # userrl_megatron.fleet.launch.ServerProcess
        self.followers: list[Any] = []  # Ray handles of the other nodes' EngineServers (node rank 0 only)
        self.started: list[EngineProcess] = []  # dry: what each start would have run, followers included

    def start(self, dist_init_addr: str = "") -> str:
        """Launch the server (node rank 0: the followers first) and wait until it is healthy; returns its URL
        ("" on a follower, which serves nothing and is not waited for)."""
        from userrl_megatron.fleet.launch import run_launch

        spec = self.launch
        leads = spec.nnodes > 1 and spec.node_rank == 0
        sglang = spec.backend == "sglang"
        ports = self._ports(int(leads) + int(not spec.port) + int(sglang))
        if leads:
            dist_init_addr = f"{ray.util.get_node_ip_address()}:{ports.pop()}"
            if not self.followers:
                actor = _engine_server_actor()
                self.followers = [actor.options(**options).remote(f) for options, f in spec.followers]
            ray.get([f.start.remote(dist_init_addr) for f in self.followers])
        nccl_port = ports.pop() if sglang else 0
        launch = self._process(spec.port or ports.pop(), dist_init_addr, nccl_port)
        if spec.dry:
            here = EngineProcess(spec.index, spec.node_rank, ray.util.get_node_ip_address(), launch)
            followers = ray.get([f.records.remote() for f in self.followers])
            self.started = [here] + [p for started in followers for p in started]
            return launch.url
        timeout = spec.sglang.startup_timeout_s if spec.backend == "sglang" else spec.embedded.startup_timeout_s
        self.server = run_launch(launch, timeout, Path(spec.log_path) if spec.log_path else None)
        return self.server.url

    def _ports(self, count: int) -> list[int]:
        """`count` ports free on this node: from the engine's own block (`fleet/engine_ports.py`), else any."""
        spec = self.launch
        return spec.ports.take(count) if spec.ports is not None else [free_port() for _ in range(count)]

    def _process(self, port: int, dist_init_addr: str, nccl_port: int = 0) -> ProcessLaunch:
        """What this process runs: the server's command line, environment and URL."""
        from userrl_megatron.fleet.launch import embedded_launch
        from userrl_megatron.fleet.sglang import NodeSpan, resolve_device, sglang_launch

        spec = self.launch
        ip = ray.util.get_node_ip_address()
        name = served_model_name(spec.model_path)
        if spec.backend != "sglang":
            return embedded_launch(
                spec.model_path, spec.embedded, port, spec.dtype, name, gpus=spec.gpus, node_ip=ip,
                api_key=spec.api_key, api_key_env=spec.api_key_env,
            )  # fmt: skip
        device = resolve_device(spec.sglang, bool(spec.gpus or ray.get_gpu_ids()))
        span = NodeSpan(spec.nnodes, spec.node_rank, dist_init_addr) if spec.nnodes > 1 else None
        return sglang_launch(
            spec.sglang, spec.model_path, spec.tp, port, spec.dtype, device, spec.gpus, spec.colocated, span, ip,
            name, api_key=spec.api_key, api_key_env=spec.api_key_env, nccl_port=nccl_port,
        )  # fmt: skip

    def records(self) -> list[EngineProcess]:
        """Dry: what the last start would have run, node rank 0 first."""
        return list(self.started)

    def restart(self, launch: EngineLaunch | None = None) -> str:
        """Stop and start again; with `launch`, as that (its followers as its followers' launches)."""
        self.stop()
        if launch is not None:
            self.launch = launch
            ray.get([f.relaunch.remote(part) for f, (_, part) in zip(self.followers, launch.followers, strict=True)])
        return self.start()

    def relaunch(self, launch: EngineLaunch) -> None:
        """A follower's next start runs `launch`."""
        self.launch = launch

    def stop(self) -> None:
        if self.followers:
            ray.get([f.stop.remote() for f in self.followers])
        if self.server is not None:
            self.server.stop()
            self.server = None

    def alive(self) -> bool:
        """This process runs, and so does every follower's."""
        if self.server is None or not self.server.alive():
            return False
        return all(ray.get([f.alive.remote() for f in self.followers]))

    def pid(self) -> int:
        """The server process id (-1 when none runs)."""
        return self.server.process.pid if self.server is not None else -1

    def kill_server(self) -> int:
        """SIGKILL the server process, as a crash would (fault drills), on the node it runs on; returns its pid."""
        pid = self.pid()
        if pid > 0:
            os.kill(pid, signal.SIGKILL)
        return pid

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines) if self.server is not None else ""


@dataclass(eq=False)
class Engine:
    """The driver's view of one engine."""

    index: int
    actor: Any
    url: str = ""
    client: SGLangClient | None = None
    outstanding: int = 0  # generate requests in flight
    healthy: bool = False
    restarts: int = 0  # restarts since the engine last served a request
    epoch: int = 0  # bumped at each restart: a failure seen under an older epoch is that engine's death
    dropped: bool = False  # out of restarts: never used again
    served: int = 0  # generate requests answered
    progress_at: float = field(default_factory=time.monotonic)  # last request answered or generation probe passed
    recovery: asyncio.Task | None = None


class RolloutPool:
    """Engines on Ray with sticky least-outstanding routing, failover, restarts, health checks, pause/resume.

    Use inside one event loop: `async with RolloutPool(...) as pool:` then `pool.session(episode_id)` gives
    each episode its engine handle (what `EpisodeRunner.run_groups` asks for).
    """

    heartbeat_s = HEARTBEAT_S  # seconds between `rollout pool: N/M engines up` lines while the servers start

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        dtype: str = "float32",
        placement: Any = None,
        log_dir: str | Path | None = None,
        dry: bool = False,
        restart_cfg: RolloutConfig | None = None,
    ) -> None:
        self.cfg = cfg
        # What a restarted engine is launched with (None: `cfg`): the simulator's engines on the policy engines'
        # GPUs find the policy's share held then, which SGLang's fraction must count (`fleet.simulator`).
        self.restart_cfg = restart_cfg
        self.model_path = model_path
        self.dtype = dtype
        self.placement = placement  # userrl_megatron.fleet.placement.Placement, or None
        self.log_dir = Path(log_dir) if log_dir else None
        self.restart_hooks: list[RestartHook] = []
        self.engines: list[Engine] = []
        self.restarts_total = 0  # engine restarts over the pool's life (metrics)
        self._running = asyncio.Event()  # cleared while paused
        self._changed = asyncio.Condition()  # an engine became healthy or was dropped
        self._health_task: asyncio.Task | None = None
        self.router: Any = None  # launch.ServerProcess of sglang-router (rollout.router: sglang)
        self.router_client: SGLangClient | None = None  # generation goes through it when set
        self.dry = dry  # engines record what they would run; nothing is launched (`trainer/dry_run.py`)
        self.router_launch: ProcessLaunch | None = None  # dry: what the router would run
        self.api_key = run_api_key(cfg.api_key_env)  # what every engine and the router require (docs/engine.md)
        self.port_blocks: dict[int, PortBlock] = {}  # each engine's ports, kept across restarts (`engine_ports`)

    @property
    def served_model_name(self) -> str:
        """The model's name on the engines' OpenAI routes (what a client sends as `model`)."""
        return served_model_name(self.model_path)

    # ---- lifecycle ----

    async def start(self) -> None:
        """Create one actor per engine, start every server (in parallel), connect, start health checks."""
        launches = [self._launch(i) for i in range(self.cfg.num_engines)]  # a placement problem fails here
        self.engines = [Engine(i, self._actor(launch)) for i, launch in enumerate(launches)]
        up = [0]

        async def start_one(engine: Engine) -> str:
            url = await engine.actor.start.remote()
            up[0] += 1
            return url

        def describe() -> str:
            return f"rollout pool: {up[0]}/{len(self.engines)} {self.cfg.backend} engines up"

        try:
            async with heartbeat(describe, self.heartbeat_s):
                urls = await asyncio.gather(*(start_one(e) for e in self.engines))
        except BaseException:
            await self.close()
            raise
        for engine, url in zip(self.engines, urls, strict=True):
            engine.url, engine.client, engine.healthy = url, self._client(url), True
            engine.progress_at = time.monotonic()
        if self.cfg.router == "sglang":
            await self._start_router(urls)
        self._running.set()
        if self.cfg.health_check_interval_s > 0 and not self.dry:
            self._health_task = asyncio.create_task(self._health_loop())
        log.info("rollout pool: %d %s engines at %s", len(self.engines), self.cfg.backend, ", ".join(urls))

    async def close(self) -> None:
        """Stop health checks and restarts, every server and every actor."""
        tasks = [self._health_task] + [e.recovery for e in self.engines]
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for engine in self.engines:
            if engine.client is not None:
                await engine.client.close()
            with contextlib.suppress(*ACTOR_GONE):
                await engine.actor.stop.remote()
                ray.kill(engine.actor)
        self.engines = []
        if self.router_client is not None:
            await self.router_client.close()
            self.router_client = None
        if self.router is not None:
            self.router.stop()
            self.router = None

    async def _start_router(self, urls: list[str]) -> None:
        """sglang-router in front of the engines: generation goes through it, control calls do not."""
        from userrl_megatron.fleet.router import launch_router, router_launch

        log_path = self.log_dir / "router.log" if self.log_dir else None
        key, key_env = self.api_key, self.cfg.api_key_env
        if self.dry:
            self.router_launch = router_launch(
                self.cfg.sglang, urls, free_port(), free_port(), self.cfg.router_policy, key, key_env
            )
            return
        self.router = await asyncio.to_thread(
            launch_router, self.cfg.sglang, urls, free_port(), free_port(), self.cfg.router_policy, log_path,
            api_key=key, api_key_env=key_env,
        )  # fmt: skip
        self.router_client = self._client(self.router.url)

    async def _reroute(self, old_url: str, new_url: str) -> None:
        """A restarted engine has a new URL: swap it in the router's worker list."""
        from userrl_megatron.fleet.router import replace_worker

        if self.router is not None:
            await asyncio.to_thread(replace_worker, self.router.url, old_url, new_url, self.api_key)

    async def __aenter__(self) -> "RolloutPool":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- what the trainer and the runner use ----

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def clients(self) -> list[SGLangClient]:
        """One client per engine, in engine order (weight sync addresses every engine)."""
        return [e.client for e in self.engines if e.client is not None]

    @property
    def exhausted(self) -> bool:
        """Every engine failed and was given up: nothing can generate any more."""
        return bool(self.engines) and all(e.dropped for e in self.engines)

    @property
    def concurrency(self) -> int:
        """Episodes to keep in flight: `max_concurrent_episodes` per live engine."""
        return self.cfg.max_concurrent_episodes * max(1, sum(not e.dropped for e in self.engines))

    def add_restart_hook(self, hook: RestartHook) -> None:
        """Run `hook(index, client)` after each engine restart, before the engine serves again (hooks run in the
        order added; one that raises fails that restart attempt)."""
        self.restart_hooks.append(hook)

    def session(self, episode_id: str = "") -> "EngineSession":
        """An engine handle for one episode: its turns stay on one engine while that engine lives."""
        return EngineSession(self, episode_id)

    async def pause(self, mode: str = "abort") -> None:
        """Hold new requests and pause every engine; requests aborted by the pause are resent after `resume`."""
        self._running.clear()
        await self._each(lambda c: c.pause(mode))

    async def resume(self) -> None:
        await self._each(lambda c: c.resume())
        self._running.set()

    async def flush_cache(self) -> None:
        await self._each(lambda c: c.flush_cache())

    async def check_health(self, generating: bool = True) -> list[bool]:
        """Probe every engine once; a dead or wedged one is restarted in the background. `generating=False`
        checks only that each engine lives (for paused engines, which hold generation)."""
        return list(await asyncio.gather(*(self._probe(e, generating) for e in self.engines)))

    async def repair(self, timeout_s: float) -> None:
        """Restart every engine that died and wait until each is back or given up (also while paused)."""
        await self.check_health(generating=False)
        await self.wait_ready(timeout_s)
        if self.exhausted:
            raise EngineError("every engine of the rollout pool failed and was given up")

    async def restart(self, urls: list[str], timeout_s: float) -> list[SGLangClient]:
        """Restart the engines now at `urls` (e.g. they refused a weight update, so their weights may be corrupt)
        and wait until every engine serves again or is given up; returns the restarted engines' clients."""
        targets = [e for e in self.engines if e.url in urls and not e.dropped]
        for engine in targets:
            self._recover(engine, "it refused a weight update (its weights may be partly overwritten)")
        await self.wait_ready(timeout_s)
        return [e.client for e in targets if e.healthy and e.client is not None]

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every engine that is not given up is healthy (e.g. after restarts)."""

        def ready() -> bool:
            return all(e.healthy or e.dropped for e in self.engines)

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(ready), timeout_s)

    async def kill_engine_server(self, index: int) -> int:
        """SIGKILL engine `index`'s server process, as a crash would, for fault drills (`trainer/drills.py`) and tests;
        returns its pid (-1 when none ran). The pool finds the engine dead and restarts it like any other."""
        return await self.engines[index].actor.kill_server.remote()

    # ---- internals ----

    def check_placement(self) -> None:
        """Raise what would stop an engine from being placed (before anything starts)."""
        for index in range(self.cfg.num_engines):
            self._launch(index)

    async def launch_records(self) -> list[EngineProcess]:
        """Dry: what every engine process would run, engine by engine (node rank 0 first)."""
        started = await asyncio.gather(*(e.actor.records.remote() for e in self.engines))
        return [p for processes in started for p in processes]

    def _new_actor(self, index: int) -> Any:
        return self._actor(self._launch(index, restarted=True))

    def _actor(self, launch: EngineLaunch) -> Any:
        options = self.placement.engine_options(launch.index) if self.placement is not None else {"num_cpus": 0}
        return _engine_server_actor().options(**options).remote(launch)

    def _launch(self, index: int, restarted: bool = False) -> EngineLaunch:
        """Engine `index`'s launch (`restarted`: with `restart_cfg` when set): with a placement, its GPUs on its
        first node, and one follower per further node it spans. Raises UserError when the driver could not reach
        it."""
        rollout = self.restart_cfg if restarted and self.restart_cfg is not None else self.cfg
        backend = rollout.backend
        base_port = rollout.sglang.base_port if backend == "sglang" else rollout.embedded.base_port
        launch = EngineLaunch(
            backend,
            self.model_path,
            self.dtype,
            base_port + index if base_port else 0,
            rollout.engine_tp,
            replace(rollout.embedded, threads=engine_threads(rollout)),
            rollout.sglang,
            str(self.log_dir / f"engine_{index}.log") if self.log_dir else "",
            index=index,
            colocated=rollout.colocate,
            dry=self.dry,
            api_key=self.api_key,
            api_key_env=rollout.api_key_env,
            ports=self._port_block(index),
        )
        if self.placement is None:
            return launch
        parts = self.placement.engine_parts(index)
        self._check_reachable(index, parts[0].slot)
        followers = [
            (
                self.placement.part_options(part),
                replace(
                    launch,
                    gpus=part.gpus,
                    nnodes=len(parts),
                    node_rank=part.node_rank,
                    log_path=str(self.log_dir / f"engine_{index}_node{part.node_rank}.log") if self.log_dir else "",
                ),
            )
            for part in parts[1:]
        ]
        return replace(launch, gpus=parts[0].gpus, nnodes=len(parts), followers=followers)

    def _port_block(self, index: int) -> PortBlock:
        """Engine `index`'s ports: a block of its own from the driver's `BOOK`, the same at every restart."""
        if index not in self.port_blocks:
            self.port_blocks[index] = BOOK.block()
        return self.port_blocks[index]

    def _check_reachable(self, index: int, slot: Any) -> None:
        """An engine on another node than the driver's must listen on an address the driver can reach."""
        from userrl_megatron.errors import UserError
        from userrl_megatron.fleet.launch import is_loopback

        backend = self.cfg.backend
        host = self.cfg.sglang.host if backend == "sglang" else self.cfg.embedded.host
        if slot.node_id != self.placement.driver_node_id and is_loopback(host):
            raise UserError(
                f"engine {index} runs on node {slot.node} ({slot.ip}), not the driver's, and rollout.{backend}.host "
                f"= {host} is reachable from its own node only: set rollout.{backend}.host = 0.0.0.0"
            )

    def _log_of(self, engine: Engine) -> str:
        return str(self.log_dir / f"engine_{engine.index}.log") if self.log_dir else "not kept"

    def _client(self, url: str) -> SGLangClient:
        # One quick transport retry: beyond that, failing over to another engine is faster than waiting.
        return SGLangClient(
            url, timeout_s=self.cfg.request_timeout_s, max_retries=1, backoff_s=0.2, api_key=self.api_key
        )

    async def _each(self, call: Callable[[SGLangClient], Awaitable[None]]) -> None:
        live = [e.client for e in self.engines if e.healthy and e.client is not None]
        await asyncio.gather(*(call(c) for c in live))

    async def _pick(self) -> Engine:
        """The healthy engine with the fewest outstanding requests (waits while all are restarting)."""
        async with self._changed:
            while True:
                live = [e for e in self.engines if e.healthy]
                if live:
                    return min(live, key=lambda e: (e.outstanding, e.index))
                if all(e.dropped for e in self.engines):
                    raise EngineError("every engine of the rollout pool failed and was given up")
                await self._changed.wait()

    async def _failed(self, engine: Engine, epoch: int) -> bool:
        """After a request error on `engine`: True if the engine is down (restart started), False if it is fine."""
        return engine.epoch != epoch or not engine.healthy or not await self._probe(engine)

    async def _probe(self, engine: Engine, generating: bool = True) -> bool:
        """Is the engine alive (process up, server answering) and, with `generating`, making progress? A slow
        engine counts as healthy; a dead or wedged one starts its recovery."""
        if engine.dropped or not engine.healthy:
            return False
        problem = await self._liveness_problem(engine)
        stall = self.cfg.engine_stall_timeout_s
        if problem is None and generating and time.monotonic() - engine.progress_at > stall:
            assert engine.client is not None
            if await engine.client.health(timeout_s=stall):  # a generation probe, queued behind the real work
                engine.progress_at = time.monotonic()
            else:
                problem = f"wedged: no request finished and no generation probe passed for {stall:.0f} s"
        if problem is None:
            return True
        self._recover(engine, problem)
        return False

    async def _liveness_problem(self, engine: Engine) -> str | None:
        """Why the engine is dead (process gone, server not answering), or None while it lives."""
        try:
            if not await engine.actor.alive.remote():
                return "its server process exited"
        except ACTOR_GONE as e:
            return f"its Ray actor died ({type(e).__name__})"
        assert engine.client is not None
        try:
            await engine.client.get_model_info()  # answered by the HTTP front end, never queued behind generation
        except EngineError as e:
            return f"its server does not answer ({e})"
        return None

    def _recover(self, engine: Engine, reason: str) -> None:
        if engine.recovery is not None and not engine.recovery.done():
            return
        engine.healthy = False
        log.warning("engine %d (%s) is down: %s", engine.index, engine.url, reason)
        engine.recovery = asyncio.create_task(self._restart(engine))

    async def _restart(self, engine: Engine) -> None:
        while engine.restarts < self.cfg.engine_max_restarts:
            engine.restarts += 1
            self.restarts_total += 1
            log.warning("engine %d: restart %d of %d", engine.index, engine.restarts, self.cfg.engine_max_restarts)
            try:
                try:
                    relaunch = self._launch(engine.index, restarted=True) if self.restart_cfg is not None else None
                    url = await engine.actor.restart.remote(relaunch)
                except ACTOR_GONE:  # the actor itself died: replace it
                    engine.actor = self._new_actor(engine.index)
                    url = await engine.actor.start.remote()
                if engine.client is not None:
                    await engine.client.close()
                if url != engine.url:
                    await self._reroute(engine.url, url)
                engine.url, engine.client, engine.epoch = url, self._client(url), engine.epoch + 1
                engine.progress_at = time.monotonic()
                for hook in self.restart_hooks:
                    await hook(engine.index, engine.client)
            except Exception as e:
                log.error("restarting engine %d failed: %s", engine.index, e)
                continue
            await self._set(engine, healthy=True)
            return
        log.error(
            "engine %d given up after %d failed restarts (log: %s)", engine.index, engine.restarts, self._log_of(engine)
        )
        await self._set(engine, dropped=True)

    async def _set(self, engine: Engine, healthy: bool = False, dropped: bool = False) -> None:
        async with self._changed:
            engine.healthy, engine.dropped = healthy, dropped
            self._changed.notify_all()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            if not self._running.is_set():
                continue  # a paused engine does not generate: its health probe would wait until resume
            try:
                await self.check_health()
            except Exception:  # keep checking: one failed round must not end the health checks
                log.exception("engine health check failed")


class EngineSession:
    """One episode's engine handle (`generate` only): sticky routing with failover and pause handling."""

    def __init__(self, pool: RolloutPool, episode_id: str = "") -> None:
        self.pool = pool
        self.episode_id = episode_id
        self.engine: Engine | None = None
        self.history: list[int] = []  # engine index that served each generate

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        if self.pool.router_client is not None:
            return await self._generate_routed(input_ids, sampling, routed_experts_start_len)
        failovers = 0
        while True:
            await self.pool._running.wait()
            if self.engine is None or not self.engine.healthy:
                self.engine = await self.pool._pick()
            engine, epoch = self.engine, self.engine.epoch
            assert engine.client is not None
            engine.outstanding += 1
            try:
                generation = await engine.client.generate(input_ids, sampling, routed_experts_start_len)
            except EngineError:
                if failovers >= self.pool.cfg.generate_failovers or not await self.pool._failed(engine, epoch):
                    raise
                failovers += 1
                log.warning("episode %s: engine %d failed, moving on", self.episode_id, engine.index)
                self.engine = None
                continue
            finally:
                engine.outstanding -= 1
            engine.progress_at = time.monotonic()
            if generation.finish_reason == "abort" and not self.pool._running.is_set():
                continue  # aborted by a pause: generate the turn again after resume
            engine.served += 1
            engine.restarts = 0  # it serves again: a later failure starts a fresh count of restarts
            self.history.append(engine.index)
            return generation

    async def _generate_routed(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        """Through sglang-router (it picks the engine and retries); turns aborted by a pause are sent again."""
        client = self.pool.router_client
        assert client is not None
        while True:
            await self.pool._running.wait()
            generation = await client.generate(input_ids, sampling, routed_experts_start_len)
            if generation.finish_reason == "abort" and not self.pool._running.is_set():
                continue
            return generation


def engine_threads(rollout: RolloutConfig) -> int:
    """Torch threads of each embedded engine: `rollout.embedded.threads`, else the cores this process may use
    (`cores.core_count`) shared among the engines, in `one_step_off` mode half of them (the trainer computes
    alongside). Ray sets OMP_NUM_THREADS=1 in an actor holding one CPU bundle, which the server would inherit: one
    core for the rollout while the trainer, waiting for it in `sync` mode, leaves the others idle."""
    cores = core_count()
    if rollout.mode == "one_step_off":
        cores //= 2
    return rollout.embedded.threads or max(1, cores // rollout.num_engines)


@functools.cache
def _engine_server_actor() -> Any:
    return ray.remote(EngineServer)
