"""The embedded engine's operations, with SGLang's semantics and messages; usable in-process without HTTP.

Every method that touches the model runs on the scheduler thread (`Scheduler.call`); the coroutines here only
wait. Weight updates follow SGLang 0.5.23: they must run inside `begin_weight_update`/`end_weight_update`; when
the engine is not paused they wait until in-flight requests finish (new ones queue behind them); when it is
paused they run at once.
"""

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.server.grammar import Grammars
from userrl_megatron.server.model import EngineModel
from userrl_megatron.server.relay import StoreRelay
from userrl_megatron.server.rendezvous import check_group_args, listening
from userrl_megatron.server.sampling import parse_sampling_params
from userrl_megatron.server.scheduler import PAUSE_MODES, Request, Scheduler, engine_failed
from userrl_megatron.server.threads import DaemonPool, start_daemon, wait_bounded
from userrl_megatron.server.weights import Destination, receive_weights
from userrl_megatron.server.weights_dir import OutsideError, check_path_text, read_safetensors_dir
from userrl_megatron.wire.bucket import FlatBuffer
from userrl_megatron.wire.group import custom_process_group_on_store, destroy_custom_process_group
from userrl_megatron.wire.handles import Segments
from userrl_megatron.wire.receive import decode_payload

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
SELECTORS = ("target", "draft", "all")
HEALTH_RID_PREFIX = "HEALTH_CHECK"
MAX_STALE_JOINS = 4  # superseded or timed-out group joins whose threads have not ended yet; more inits wait
STALE_WAIT_S = 10.0  # how long a new init waits for one of them to end before it is refused
STALE_POLL_S = 0.05
TOKENIZER_THREADS = 4  # text prompts tokenised at once, off the event loop
STOP_GRACE_S = 5.0  # how long shutdown waits for the scheduler thread (a forward, a broadcast) before leaving it
JOIN_GRACE_S = 10.0  # how long shutdown waits for the threads of stopped joins (a store slice, a back-off pause)


@dataclass(eq=False)
class _Join:
    """One `init_weights_update_group` in progress; `abandoned` once its caller stopped waiting for it."""

    group_name: str
    wake: asyncio.Event  # set when a newer init (or shutdown) supersedes this one
    reason: str = ""  # why it was superseded
    in_thread: bool = False  # the blocking join has started in its thread
    finished: bool = False  # ... and ended
    abandoned: bool = False  # its caller was answered with a failure before it ended
    relay: StoreRelay | None = None  # the rendezvous traffic's relay; closing it ends the thread's wait


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class EngineCore:
    """One model, one scheduler, the weight-update groups and the server's labels."""

    def __init__(
        self,
        model_path: str,
        cfg: EmbeddedServerConfig,
        dtype: str = "float32",
        served_model_name: str = "",
        weight_version: str = "default",
        accept_pickle_payloads: bool = False,
    ):
        self.cfg = cfg
        # Whether /update_weights_from_tensor reads SGLang's pickle format too (`userrl serve
        # --accept-pickle-payloads`, for the conformance suite); weight senders write this engine's own format.
        self.accept_pickle_payloads = accept_pickle_payloads
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.model = EngineModel(model_path, dtype, resolve_device(cfg.device), cfg.context_length, cfg.cpu_linear)
        self.scheduler = Scheduler(
            self.model,
            cfg.max_running_requests,
            cfg.max_prefill_tokens,
            weight_version,
            cfg.random_seed,
            cfg.prefix_cache_tokens,
            cfg.enable_return_routed_experts,
        )
        self.groups: dict[str, tuple[Any, str]] = {}  # group name -> (process group, backend)
        self._relays: dict[str, StoreRelay] = {}  # group name -> the relay to its store, closed with the group
        self._joining: set[StoreRelay] = set()  # the relays of joins whose threads have not ended
        self._join: _Join | None = None  # the one pending group join
        self._stale_joins = 0  # abandoned joins whose threads have not ended yet
        self._join_lock = threading.Lock()  # groups, _relays, _join and _stale_joins, shared with the join threads
        self._tokenizers = DaemonPool(TOKENIZER_THREADS, "tokenizer")
        self._receive_buffers: dict[str, FlatBuffer] = {}  # device -> the flat bucket buffer reused across updates
        self._session: str | None = None  # selector of the open weight-update session
        self.segments = Segments()  # the senders' bucket memory mapped by /update_weights_from_tensor, kept
        self._released: set[str] = set()
        # What one /update_weights_from_tensor payload may hold: 8 bytes per parameter (the whole model twice in
        # float32), at least 1 GiB (a shared bucket of sync.bucket_mb is mapped whole); or the configured bound.
        params = sum(p.numel() for p in self.model.model.parameters())
        self.payload_limit = cfg.max_weight_payload_bytes or max(8 * params, 1 << 30)
        self.started = False
        self.startup_time = time.time()
        self.grammars = Grammars(
            self.model.tokenizer,
            self.model.spec.vocab_size,
            self.model.spec.eos_token_ids,
            any_whitespace=not cfg.constrained_json_disable_any_whitespace,
            max_whitespace_cnt=cfg.constrained_json_max_whitespace_cnt or None,
        )

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def start(self) -> None:
        self.scheduler.start()
        self.started = True

    def begin_shutdown(self) -> None:
        """Answer everything in flight now (requests end as aborted, a pending group join fails), so that
        stopping the server waits for nothing."""
        self.scheduler.abort(abort_all=True, message="The server is shutting down.")
        self._supersede("the server is shutting down")

    def shutdown(self) -> None:
        """Stop the scheduler (waiting at most STOP_GRACE_S for a forward or a broadcast it is in) and destroy
        the weight-update groups."""
        if self.started:
            self.scheduler.stop(timeout_s=STOP_GRACE_S)
            self.started = False
        self.segments.clear()
        with self._join_lock:
            groups = [group for group, _ in self.groups.values()]
            self.groups.clear()
            relays = [*self._relays.values(), *self._joining]
            self._relays.clear()
        for group in groups:
            try:
                destroy_custom_process_group(group)
            except Exception as e:  # the scheduler thread may still be in a broadcast on it
                log.warning("destroying a weight-update group at shutdown failed: %s", e)
        for relay in relays:
            relay.stop()
        deadline = time.monotonic() + JOIN_GRACE_S
        while self._joining and time.monotonic() < deadline:
            time.sleep(STALE_POLL_S)

    async def end_joins(self) -> None:
        """Stop the joins still in their threads and wait at most JOIN_GRACE_S for those threads to end: a join
        woken while the interpreter exits aborts the process (torch's C++ unwinds through `pthread_exit`)."""
        with self._join_lock:
            relays = list(self._joining)
        for relay in relays:
            relay.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOIN_GRACE_S
        while self._joining and loop.time() < deadline:
            await asyncio.sleep(STALE_POLL_S)

    async def tokenize(self, fn: Any) -> Any:
        """Run `fn()` (tokenising, a chat template) on a tokenizer thread: a long prompt never stalls the loop."""
        return await self._tokenizers.run(fn)

    async def _on_scheduler(self, fn: Any, needs_idle: bool = False) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn, needs_idle=needs_idle))

    # ---- generation ----

    def routing_problem(self) -> str:
        """Why this engine cannot return routed experts ("" when it can)."""
        if not self.model.is_moe:
            return f"the model ({self.model.spec.model_type}) is dense: it routes no experts"
        if not self.scheduler.records_routing:
            return "this server records no routing: start it with --enable-return-routed-experts"
        return ""

    def check_input(self, input_ids: list[int], max_new_tokens: int) -> None:
        """SGLang's input checks (empty input, context length) plus token-id range, and weights to run on (where
        SGLang would generate from garbage); raises ValueError."""
        if problem := self.model.unloaded_error():
            raise ValueError(f"Cannot generate: {problem}.")
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        vocab = self.model.spec.vocab_size
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token ids must be in [0, {vocab - 1}]; got {bad[:5]}.")
        context = self.model.spec.context_length
        if len(input_ids) >= context:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length ({context} tokens)."
            )
        if max_new_tokens + len(input_ids) > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {max_new_tokens + len(input_ids)} tokens: {len(input_ids)} tokens from the "
                f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
                "in the input messages or the completion to fit within the limit."
            )

    async def attach_grammars(self, requests: list[Request]) -> None:
        """Give each structured request (`sampling.grammar`) a matcher of its grammar, compiled on a tokenizer
        thread (or found in the cache); GrammarError (a ValueError, answered as 400) when it does not compile."""
        for request in requests:
            if request.sampling.grammar is not None:
                kind, spec = request.sampling.grammar
                request.grammar = await self.tokenize(lambda k=kind, s=spec: self.grammars.matcher(k, s))

    async def generate(self, request: Request) -> Request:
        """Run one request to completion (abort included); cancelling the caller aborts the request."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        request.on_finish = lambda r: call_soon(loop, _resolve, done, r)
        self.scheduler.submit(request)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            self.scheduler.abort(request.rid)
            raise

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang `/abort_request`: rid prefix match; an empty rid without abort_all does nothing."""
        if abort_all or rid:
            self.scheduler.abort(rid, abort_all)

    # ---- pause, flush, health ----

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self._on_scheduler(lambda: self.scheduler.pause(mode))

    async def continue_generation(self) -> None:
        def resume() -> None:
            self.scheduler.paused = False

        await self._on_scheduler(resume)

    async def flush_cache(self, timeout: float = 0.0) -> tuple[bool, str]:
        """Drop cached KV; refused while requests run or wait (waits up to `timeout` seconds for idle)."""
        deadline = time.monotonic() + timeout
        while True:
            if await self._on_scheduler(self._try_flush):
                return True, ""
            if time.monotonic() >= deadline:
                message = "Timed out waiting for idle state." if timeout > 0 else ""
                return False, message
            await asyncio.sleep(0.05)

    def _try_flush(self) -> bool:
        if not self.scheduler.is_idle(ignore_waiting=self.scheduler.paused):
            return False
        if self.scheduler.is_idle():
            self.scheduler.release_kv()
        return True

    async def health(self) -> bool:
        """SGLang's `/health_generate`: alive when any request got a token after the probe was sent, or the probe
        ended for another reason than an engine error (a caller's abort: SGLang's scheduler answered). A probe
        the engine failed means unhealthy at once: where this engine aborts requests on an exception, SGLang's
        scheduler dies, and a forward whose tokens cannot be sampled is no progress."""
        if not self.started:
            return False
        tic = time.perf_counter()
        probe = Request(
            input_ids=[0],
            sampling=parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}, self.model.spec.vocab_size),
            rid=f"{HEALTH_RID_PREFIX}_{time.time_ns()}",
        )
        task = asyncio.ensure_future(self.generate(probe))
        try:
            deadline = tic + self.cfg.health_check_timeout_s
            while time.perf_counter() < deadline:
                if self.scheduler.last_progress > tic:
                    return True
                if task.done():
                    return not engine_failed(probe)
                await asyncio.sleep(0.02)
            return False
        finally:
            task.cancel()

    # ---- weight sync ----

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """Join the trainer's group as rank `rank_offset` (one rank: the embedded engine has no TP), answering
        within `control_timeout_s` (SGLang 0.5.23 waits up to torch's 30 minutes, its scheduler blocked, and
        forever where the address accepts and never answers).

        At most one join is pending: a new call supersedes it, and its caller is answered at once. Waiting for
        the rendezvous address to listen is a coroutine (nothing is left behind when it ends); the join itself,
        once something listens there, runs in a daemon thread under the same timeout and records the group
        itself unless its caller stopped waiting (so a caller that goes away loses nothing). Its store traffic
        goes through a `StoreRelay`: a join whose caller was answered with a failure (superseded, timed out,
        shut down) has its relay cut, so its thread ends within seconds."""
        try:
            await self._join_group(master_address, master_port, rank_offset, world_size, group_name, backend)
        except Exception as e:
            message = f"Failed to initialize custom process group: {e}."
            log.error(message)
            return False, message
        return True, "Succeeded to initialize custom process group."

    async def _join_group(
        self, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if not group_name:
            raise ValueError("Group name cannot be empty")
        check_group_args(address, port, rank, world_size, backend, self.model.device.type)
        timeout = self.cfg.control_timeout_s
        loop = asyncio.get_running_loop()
        give_up = loop.time() + min(STALE_WAIT_S, timeout)
        while True:  # abandoned joins end within seconds, unless already in gloo's own handshake
            with self._join_lock:
                if group_name in self.groups:
                    raise ValueError(f"group {group_name!r} already exists")
                stale = self._stale_joins
            if stale < MAX_STALE_JOINS:
                break
            if loop.time() >= give_up:
                raise RuntimeError(
                    f"{stale} abandoned joins have not ended yet (each ends within {timeout:g} s: "
                    "rollout.embedded.control_timeout_s)"
                )
            await asyncio.sleep(STALE_POLL_S)
        self._supersede(f"superseded by a newer init_weights_update_group (group {group_name!r})")
        join = _Join(group_name, asyncio.Event())
        with self._join_lock:
            self._join = join
        deadline = loop.time() + timeout
        try:
            where = f"tcp://{address}:{port}"
            upstream = await self._until(join, listening(address, port), deadline, f"nothing listens at {where}")
            join.relay = relay = StoreRelay(*upstream)
            with self._join_lock:
                self._joining.add(relay)
            join.in_thread = True
            joined = start_daemon(
                lambda: self._join_in_thread(join, backend, relay, world_size, rank, timeout), "weights-group-join"
            )
            await self._until(join, asyncio.wrap_future(joined), deadline, f"the rendezvous at {where} is incomplete")
        finally:
            with self._join_lock:
                if self._join is join and not (join.in_thread and not join.abandoned):
                    self._join = None  # a join still in its thread stays pending until the thread is done

    def _join_in_thread(
        self, join: _Join, backend: str, relay: StoreRelay, world_size: int, rank: int, timeout: float
    ) -> None:
        try:
            store = relay.open_store(world_size, timedelta(seconds=timeout))
            group = custom_process_group_on_store(
                backend, store, world_size, rank, join.group_name, timedelta(seconds=timeout)
            )
        except BaseException:
            self._join_done(join)
            relay.stop()
            raise
        if not self._join_done(join, group, backend, relay):  # its caller was told it failed: nobody will use it
            with contextlib.suppress(Exception):  # its store is gone
                destroy_custom_process_group(group)
            relay.stop()
            raise RuntimeError(f"group {join.group_name!r} was joined after its caller gave up; destroyed")

    def _join_done(self, join: _Join, group: Any = None, backend: str = "", relay: StoreRelay | None = None) -> bool:
        """Record a finished join (its group and relay, unless abandoned); whether the group was kept."""
        with self._join_lock:
            join.finished = True
            if join.relay is not None:
                self._joining.discard(join.relay)
            if self._join is join:
                self._join = None
            if join.abandoned:
                self._stale_joins -= 1
                return False
            if group is not None and relay is not None:
                self.groups[join.group_name] = (group, backend)
                self._relays[join.group_name] = relay
            return True

    async def _until(self, join: _Join, step: Any, deadline: float, what: str) -> Any:
        """Await `step` until it is done, the join is superseded or the deadline passes (the last two raise)."""
        task, woken = asyncio.ensure_future(step), asyncio.ensure_future(join.wake.wait())
        try:
            remaining = max(deadline - asyncio.get_running_loop().time(), 0.0)
            done, _ = await asyncio.wait({task, woken}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # a join already in its thread goes on and records its group
            raise
        finally:
            woken.cancel()
        if task in done:
            return task.result()
        with self._join_lock:
            finished = join.in_thread and join.finished
            if join.in_thread and not join.finished:
                join.abandoned = True
                self._stale_joins += 1
        if finished:  # the thread ended just now: its outcome stands
            return await task
        if join.abandoned and join.relay is not None:
            join.relay.cut()  # its store calls fail at once, and its thread ends
        task.cancel()
        if join.wake.is_set():
            raise RuntimeError(join.reason)
        raise TimeoutError(f"{what} after {self.cfg.control_timeout_s:g} s (rollout.embedded.control_timeout_s)")

    def _supersede(self, reason: str) -> None:
        """Wake the pending join's caller with `reason`; its thread, if it started one, is abandoned."""
        with self._join_lock:
            join = self._join
            self._join = None
        if join is not None and not join.wake.is_set():
            join.reason = reason
            join.wake.set()

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        with self._join_lock:
            entry = self.groups.pop(group_name, None)
            relay = self._relays.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        try:
            destroy_custom_process_group(entry[0])
        except Exception as e:
            return False, f"Failed to destroy custom process group: {e}."
        finally:
            if relay is not None:
                relay.stop()
        return True, "Succeeded to destroy custom process group."

    async def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        if selector not in SELECTORS:
            return False, f"selector must be one of {', '.join(SELECTORS)}, got {selector!r}"
        if self._session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = selector
        return True, "Success"

    async def end_weight_update(self) -> tuple[bool, str]:
        if self._session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = None
        self.segments.end_push()
        return True, "Success"

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """Receive the trainer's broadcast(s) and load them; see the module docstring for locking."""
        if self._session is None:
            return False, (
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        if abort_all_requests:
            self.scheduler.abort(abort_all=True)
        entry = self.groups.get(group_name)

        def update() -> tuple[bool, str]:
            if entry is None:
                return False, (
                    f"Group {group_name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
                )
            if released := self._released_weights():
                return False, released
            try:
                device = torch.device("cpu") if entry[1] == "gloo" else self.model.device
                buffer = self._receive_buffers.setdefault(str(device), FlatBuffer(device))
                weights = receive_weights(
                    entry[0], names, dtypes, shapes, load_format, device, buffer, self._receive_target(device)
                )
                self.model.load_weights(weights)
            except Exception as e:
                return False, (
                    f"Failed to update parameter online: {e}. The full weights of the ModelRunner are partially "
                    "updated. Please discard the whole weights."
                )
            self.model.mark_loaded(names)
            if weight_version is not None:
                self.scheduler.weight_version = weight_version
            if flush_cache and not self._try_flush():
                return False, (
                    "Weights were updated, but the cache was not flushed because requests are still running or "
                    "queued. Retract or finish them, then call /flush_cache."
                )
            return True, "Succeeded to update parameter online."

        return await self._on_scheduler(update, needs_idle=True)

    def _released_weights(self) -> str:
        """Why a weight update cannot land now ("" when it can): the weights' memory is released."""
        if "weights" in self._released:
            return "the weights' memory is released: resume it (/resume_memory_occupation) before a weight update"
        return ""

    def _receive_target(self, device: torch.device) -> Destination:
        """Where a per-tensor update on `device` lands: the model's own memory when loading it would copy it."""
        return lambda name, dtype, shape: self.model.receive_target(name, dtype, shape, device)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """SGLang's colocated path: this engine's payload (entry 0; it is TP rank 0) names tensors in memory the
        sender shares (`wire/handles.py`), in this engine's own format (`wire/embedded_payload.py`), or in
        SGLang's pickle format only with `accept_pickle_payloads`; they are mapped and copied into the weights
        before the answer, and the mapping of a sender's persistent shared-memory file is kept for its next pushes
        (`Segments`). Where SGLang 0.5.23's server dies (a payload it cannot read, an unknown load format, a wrong
        shape) this one refuses."""
        if self._session is None:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if abort_all_requests:
            self.scheduler.abort(abort_all=True)

        def load() -> tuple[bool, str]:
            if released := self._released_weights():
                return False, released
            try:
                named = decode_payload(
                    serialized_named_tensors,
                    load_format,
                    0,
                    self.payload_limit,
                    self.segments,
                    accept_pickle=self.accept_pickle_payloads,
                )
                self.model.load_weights(named)
                if self.model.device.type == "cuda":  # the copies out of the sender's segment have run before
                    torch.cuda.synchronize(self.model.device)  # the answer lets the sender write there again
            except Exception as e:
                return False, f"Failed to update parameter online: {e}"
            self.model.mark_loaded(name for name, _ in named)
            if weight_version is not None:
                self.scheduler.weight_version = weight_version
            if flush_cache and not self._try_flush():
                return False, "Weights were updated, but the cache was not flushed because requests are still running."
            return True, "Success" + (f" Weight version updated to {weight_version}." if weight_version else "")

        return await self._on_scheduler(load, needs_idle=True)

    async def update_weights_from_disk(
        self,
        model_path: str,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        allow_partial: bool = False,
    ) -> tuple[bool, str]:
        """Load a safetensors checkpoint directory; on failure the previous weights are put back (as SGLang).

        Stricter than SGLang: only from directories the server was started with (`--weights-dir`, none: the
        endpoint is off), only inside a weight-update session, and only a checkpoint with every parameter of the
        model unless `allow_partial`."""
        if not self.cfg.weight_dirs:
            return False, (
                "update_weights_from_disk is off on this server: start it with --weights-dir DIR "
                "(rollout.embedded.weight_dirs) to load checkpoints from DIR"
            )
        if self._session is None:
            return False, "update_weights_from_disk must run between begin_weight_update() and end_weight_update()"
        try:
            check_path_text(model_path)
            named = await wait_bounded(
                start_daemon(lambda: read_safetensors_dir(model_path, self.cfg.weight_dirs), "weights-from-disk"),
                self.cfg.control_timeout_s,
                f"reading {model_path}",
            )
        except OutsideError:
            return False, (
                f"Failed to get weights iterator: {model_path!r} is not in a directory this server loads from "
                "(--weights-dir)."
            )
        except Exception as e:
            return False, f"Failed to get weights iterator: {e}."
        missing = [] if allow_partial else self.model.missing_tensors(name for name, _ in named)
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            return False, (
                f"Failed to get weights iterator: {model_path} lacks {len(missing)} of the model's parameters "
                f"({shown}); a partial load needs allow_partial: true."
            )
        backup = {name: p.detach().to("cpu", copy=True) for name, p in self.model.model.named_parameters()}
        ok, message = await self._load(named, flush_cache, abort_all_requests, weight_version)
        if ok:
            self.model_path = model_path
            return True, "Succeeded to update model weights."

        def restore() -> None:
            with torch.no_grad():
                for name, p in self.model.model.named_parameters():
                    p.copy_(backup[name])

        await self._on_scheduler(restore, needs_idle=True)
        return False, f"Failed to update weights: {message}. Rolling back to original weights."

    async def _load(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        flush_cache: bool,
        abort_all_requests: bool,
        weight_version: str | None,
    ) -> tuple[bool, str]:
        if abort_all_requests:
            self.scheduler.abort(abort_all=True)

        def load() -> tuple[bool, str]:
            if released := self._released_weights():
                return False, released
            try:
                self.model.load_weights(named_tensors)
            except Exception as e:
                return False, f"Failed to update parameter online: {e}"
            self.model.mark_loaded(name for name, _ in named_tensors)
            if weight_version is not None:
                self.scheduler.weight_version = weight_version
            if flush_cache and not self._try_flush():
                return False, "Weights were updated, but the cache was not flushed because requests are still running."
            return True, "Succeeded to update parameter online."

        return await self._on_scheduler(load, needs_idle=True)

    def load(self) -> list[dict[str, Any]]:
        """`/get_load`: one entry per data-parallel rank (the embedded engine has one)."""
        running, waiting = self.scheduler.counts()
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": 0}]

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        if abort_all_requests:
            self.scheduler.abort(abort_all=True)

        def set_version() -> None:
            self.scheduler.weight_version = new_version

        await self._on_scheduler(set_version)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any] | None:
        """First rows of weight `name`; None for a name the model lacks, ValueError for one it holds no value of."""
        if "weights" in self._released and not self.cfg.enable_weights_cpu_backup:
            raise ValueError(f"{name} holds no weights: the weights' memory is released")
        return await self._on_scheduler(lambda: self.model.get_weights_by_name(name, truncate_size))

    # ---- memory ----

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV buffers ("kv_cache") and the weights ("weights"); holds generation until resumed. Needs an
        idle engine (waiting requests allowed while paused).

        As SGLang 0.5.23, the weights are dropped unless `enable_weights_cpu_backup` keeps a host copy: a resume
        then gives memory without them, and generation is refused until a weight update or disk load has filled
        every parameter again (SGLang would generate from whatever the fresh memory holds)."""
        tags = _check_tags(tags)

        def release() -> None:
            if not self.scheduler.is_idle(ignore_waiting=self.scheduler.paused):
                raise AssertionError("release_memory_occupation should be called only when server is idle.")
            again = [t for t in tags if t in self._released]
            if again:
                raise ValueError(
                    f"memory tags {again} are already released; resume them before releasing them again "
                    "(SGLang 0.5.23 does not support releasing a tag twice)"
                )
            if "kv_cache" in tags and self.scheduler.is_idle():
                self.scheduler.release_kv()
            if "weights" in tags and not self.cfg.enable_weights_cpu_backup:
                self.model.drop_weights()
            elif "weights" in tags and self.model.device.type == "cuda":
                self.model.model.to("cpu")
            if "weights" in tags and self.model.device.type == "cuda":
                torch.cuda.empty_cache()
            self._released.update(tags)
            self.scheduler.held = True

        await self._on_scheduler(release)
        log.info("memory released: %s", ", ".join(tags))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = _check_tags(tags)

        def resume() -> None:
            held = [t for t in tags if t not in self._released]
            if held:
                raise ValueError(
                    f"memory tags {held} are not released; resume only released tags (SGLang 0.5.23's scheduler "
                    "dies with a KeyError on this call)"
                )
            if "weights" in tags and not self.cfg.enable_weights_cpu_backup:
                self.model.restore_memory()
            elif "weights" in tags and self.model.device.type == "cuda":
                self.model.model.to(self.model.device)
            self._released.difference_update(tags)
            self.scheduler.held = bool(self._released)

        await self._on_scheduler(resume)
        log.info("memory resumed: %s", ", ".join(tags))

    # ---- introspection ----

    def model_info(self) -> dict[str, Any]:
        """SGLang 0.5.23 `/model_info` fields."""
        spec = self.model.spec
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path if self.model.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": spec.model_type,
            "architectures": spec.architectures,
        }

    def server_info(self) -> dict[str, Any]:
        """Resolved settings and live state (SGLang `/server_info` shape, embedded fields)."""
        running, waiting = self.scheduler.counts()
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
            "cpu_threads": torch.get_num_threads(),
            "cpu_linear": self.model.cpu_linear,
            "context_length": self.model.spec.context_length,
            "max_running_requests": self.cfg.max_running_requests,
            "max_prefill_tokens": self.cfg.max_prefill_tokens,
            "prefix_cache_tokens": self.cfg.prefix_cache_tokens,
            "enable_return_routed_experts": self.cfg.enable_return_routed_experts,
            "weight_version": self.weight_version,
            "startup_time": self.startup_time,
            "internal_states": [
                {
                    "running": running,
                    "waiting": waiting,
                    "paused": self.scheduler.paused,
                    "decode_steps": self.scheduler.decode_steps,
                    "prefix_cache_tokens": self.scheduler.prefix.tokens,
                }
            ],
            "version": "userrl-embedded",
            "frontend": "python",
        }


def _check_tags(tags: list[str] | None) -> list[str]:
    tags = list(tags) if tags else list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; choose from {', '.join(MEMORY_TAGS)}")
    return tags


def call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Schedule `fn(*args)` on `loop` from the scheduler thread; a closed loop has no one left to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
