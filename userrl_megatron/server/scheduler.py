"""Continuous batching on one thread: new requests join between decode steps, finished ones leave.

Each loop iteration runs pending control commands, prefills waiting requests together (one padded forward, up to
a token budget), then makes one batched forward for every running request and samples their next tokens. Everything that
touches the model or the KV cache runs on this thread, so weight loads and cache flushes never race a forward;
other threads talk to it through `submit`, `abort` and `call`.
"""

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from userrl_megatron.server.kv import BatchKV
from userrl_megatron.server.model import EngineModel
from userrl_megatron.server.prefill import LayerKV, PrefillRow, run_prefill
from userrl_megatron.server.prefix import PrefixCache
from userrl_megatron.server.sampling import Sampled, SampleRow, SamplingSpec, sample

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
# On CPU a prefill batch runs in forwards of at most this many padded new tokens (rows stay whole): a larger forward's
# activations are fresh memory-mapped pages that pay their page faults in every layer (docs/engine.md).
CPU_PREFILL_FORWARD_TOKENS = 2048
# A waiting request whose first uncached tokens, this many or more, are also those of a request taken into the same
# prefill waits for the next round and reuses that one's KV (GRPO groups and shared system prompts; docs/engine.md).
SHARED_PREFIX_TOKENS = 16


@dataclass(eq=False)
class Request:
    """One sequence being generated; the scheduler thread owns its mutable state."""

    input_ids: list[int]
    sampling: SamplingSpec
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input-token log-probs
    top_logprobs_num: int = 0
    return_routed_experts: bool = False  # record the MoE routing of positions routed_experts_start_len … end - 1
    routed_experts_start_len: int = 0
    on_token: Callable[["Request"], None] | None = None  # called on the scheduler thread after each token
    on_finish: Callable[["Request"], None] | None = None  # called on the scheduler thread once
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    num_retractions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    created: float = field(default_factory=time.perf_counter)
    finished_at: float = 0.0
    matched_stop_text: str | None = None  # the stop string that ended the request, if any
    routed: list[torch.Tensor] = field(default_factory=list)  # int32 [n, layers, top_k] chunks from the start len
    grammar: Any = None  # xgrammar GrammarMatcher of a structured request (`sampling.grammar`); scheduler-owned
    _generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    needs_idle: bool  # wait until nothing is running (skipped while paused, as SGLang's writer lock is)


class Scheduler:
    """Owns the model's forward passes; see the module docstring."""

    def __init__(
        self,
        model: EngineModel,
        max_running_requests: int = 64,
        max_prefill_tokens: int = 8192,
        weight_version: str = "default",
        seed: int = 0,
        prefix_cache_tokens: int = 0,
        enable_return_routed_experts: bool = False,
    ):
        if enable_return_routed_experts and not model.is_moe:
            raise ValueError(
                f"enable_return_routed_experts needs a mixture-of-experts model; {model.spec.model_type} is dense"
            )
        self.model = model
        self.records_routing = enable_return_routed_experts  # SGLang's --enable-return-routed-experts
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.paused = False
        self.held = False  # memory released: hold generation until resumed
        self.last_progress = 0.0  # perf_counter of the last step that gave a request a token (health)
        self.decode_steps = 0  # batched forwards of running requests since start
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # row i of the KV cache belongs to _running[i]
        self._kv = BatchKV(model.spec.num_layers, max_running_requests)
        self.prefix = PrefixCache(prefix_cache_tokens)
        self._commands: deque[_Command] = deque()
        self._aborts: list[tuple[str, bool, str]] = []  # (rid prefix, abort all, message)
        self._cond = threading.Condition()
        self._stop = False
        self._generator = torch.Generator(device=model.device).manual_seed(seed)  # requests without a seed
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ---- thread-safe API ----

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the loop; wait for the thread at most `timeout_s` (a daemon thread stuck in a forward or a
        broadcast is left to end with the process)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the scheduler thread is still busy after %s s; leaving it", timeout_s)

    def submit(self, request: Request) -> None:
        """Queue a request; its `on_finish` fires on the scheduler thread (at once if the engine has stopped)."""
        with self._cond:
            if not self._stop:
                self._waiting.append(request)
                self._cond.notify()
                return
        self._finish(request, _abort_reason("The server is shutting down."))

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted") -> None:
        """Finish matching requests (rid prefix match, like SGLang) with an abort reason and their partial output."""
        with self._cond:
            self._aborts.append((rid, abort_all, message))
            self._cond.notify()

    def call(self, fn: Callable[[], Any], needs_idle: bool = False) -> Future:
        """Run `fn` on the scheduler thread between steps; the future holds its result or exception."""
        future: Future = Future()
        with self._cond:
            self._commands.append(_Command(fn, future, needs_idle))
            self._cond.notify()
        return future

    def counts(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self._running), len(self._waiting)

    # ---- operations for commands (scheduler thread only) ----

    def pause(self, mode: str) -> None:
        """SGLang pause modes: abort everything, retract running requests to the queue, or freeze in place."""
        if mode == "abort":
            self._apply_aborts([("", True, "Aborted")])
        elif mode == "retract":
            while self._running:
                request = self._running[-1]
                self._remove_row(len(self._running) - 1)
                request.num_retractions += 1
                with self._cond:
                    self._waiting.appendleft(request)
        self.paused = True

    def is_idle(self, ignore_waiting: bool = False) -> bool:
        return not self._running and (ignore_waiting or not self._waiting)

    def release_kv(self) -> None:
        """Free the KV buffers and the prefix cache (idle engine only)."""
        self._kv.release()
        self.prefix.clear()

    # ---- the loop ----

    def _run(self) -> None:
        with torch.inference_mode():  # forwards, sampling, cache copies and weight loads: no autograd anywhere
            self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._has_work():
                    self._cond.wait()
                if self._stop:
                    break
                aborts, self._aborts = self._aborts, []
                commands = list(self._commands)
            try:
                if aborts:
                    self._apply_aborts(aborts)
                self._run_commands(commands)
                if not self.paused and not self.held and (problem := self.model.unloaded_error()):
                    self._apply_aborts([("", True, f"Cannot generate: {problem}.")])  # queued before the release
                elif not self.paused and not self.held:
                    if not self._idle_command_pending():
                        self._admit()
                    if self._running:
                        self._decode()
            except Exception as e:  # a bug or an OOM: fail the running requests, keep serving
                log.exception("scheduler step failed")
                self._fail_running(e)
        self._apply_aborts([("", True, "The server is shutting down.")])
        with self._cond:
            commands, self._commands = list(self._commands), deque()
        for command in commands:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(RuntimeError("the engine has stopped"))

    def _has_work(self) -> bool:
        if self._aborts or self._commands:
            return True
        return not self.paused and not self.held and bool(self._running or self._waiting)

    def _idle_command_pending(self) -> bool:
        return any(c.needs_idle for c in self._commands)

    def _run_commands(self, commands: list[_Command]) -> None:
        for command in commands:
            if command.needs_idle and not self.paused and self._running:
                continue  # wait for the running requests to finish; new ones are not admitted meanwhile
            with self._cond:
                self._commands.remove(command)
            if not command.future.set_running_or_notify_cancel():
                continue  # its caller gave up (a timeout, a closed connection): nothing to run or answer
            try:
                result = command.fn()
            except Exception as e:
                command.future.set_exception(e)
            else:
                command.future.set_result(result)

    def _fail_running(self, error: Exception) -> None:
        """End every running request with the engine error (500), keeping its partial output."""
        for row in reversed(range(len(self._running))):
            request = self._running[row]
            self._remove_row(row)
            self._finish(request, _engine_error(error))

    def _apply_aborts(self, aborts: list[tuple[str, bool, str]]) -> None:
        def hit(request: Request) -> str | None:
            for rid, abort_all, message in aborts:
                if abort_all or (rid and request.rid.startswith(rid)):
                    return message
            return None

        for row in reversed(range(len(self._running))):
            message = hit(self._running[row])
            if message is not None:
                request = self._running[row]
                self._remove_row(row)
                self._finish(request, _abort_reason(message))
        with self._cond:
            hits = [(r, m) for r in self._waiting if (m := hit(r)) is not None]
            if hits:
                hit_ids = {id(r) for r, _ in hits}
                self._waiting = deque(r for r in self._waiting if id(r) not in hit_ids)
        for request, message in hits:
            self._finish(request, _abort_reason(message))

    def _admit(self) -> None:
        """Take waiting requests (up to the free rows and `max_prefill_tokens` of padded prefill) and prefill
        them in one forward; a request that wants prompt log-probs goes alone. A request sharing at least
        `SHARED_PREFIX_TOKENS` uncached leading tokens with one taken is left for the next round: the prompt
        of the one taken goes into the prefix cache after its prefill, and the other then computes only what
        differs (SGLang's in-batch prefix caching)."""
        batch: list[tuple[Request, PrefillRow]] = []
        keys: dict[tuple[int, ...], int] = {}  # the shared-prefix key of each row taken -> its index in `batch`
        shared: set[int] = set()  # rows taken whose prompt a request left waiting will reuse
        with self._cond:
            waiting = list(self._waiting)
        for request in waiting:
            if len(self._running) + len(batch) >= self.max_running:
                break
            row = self._prefill_row(request)
            if batch and (_wants_input(request) or _wants_input(batch[0][0])):
                break
            key = self._share_key(request, row)
            if key is not None and key in keys:
                shared.add(keys[key])
                continue
            new = max([len(row.tokens) - row.reused] + [len(r.tokens) - r.reused for _, r in batch])
            if batch and new * (len(batch) + 1) > self.max_prefill_tokens:
                break  # the first prefill of an iteration always runs
            if key is not None:
                keys[key] = len(batch)
            batch.append((request, row))
        taken = {id(request) for request, _ in batch}
        with self._cond:
            self._waiting = deque(r for r in self._waiting if id(r) not in taken)
        if not batch:
            return
        try:
            self._prefill(batch, shared)
        except Exception as e:
            log.exception("prefill failed")
            left = [r for r, _ in batch if not r.finished and not self._is_running(r)]
            if len(batch) == 1:
                for request in left:
                    self._finish(request, _engine_error(e))
                return
            for request in left:  # again one by one: a request that fails alone ends alone, the rest go on
                try:
                    self._prefill([(request, self._prefill_row(request))])
                except Exception as alone:
                    log.exception("prefill of request %s failed", request.rid)
                    if not request.finished and not self._is_running(request):
                        self._finish(request, _engine_error(alone))

    def _is_running(self, request: Request) -> bool:
        return any(r is request for r in self._running)

    def _prefill_row(self, request: Request) -> PrefillRow:
        tokens = request.input_ids + request.output_ids
        if _wants_input(request):  # prompt log-probs need every position's logits: no reuse
            return PrefillRow(tokens)
        reused, prefix = self.prefix.lookup(tokens)
        if self._routes(request):  # positions from the start length on must run through the routers
            reused = min(reused, request.routed_experts_start_len)
        return PrefillRow(tokens, reused, prefix if reused else None)

    def _routes(self, request: Request) -> bool:
        return self.records_routing and request.return_routed_experts

    def _share_key(self, request: Request, row: PrefillRow) -> tuple[int, ...] | None:
        """Its tokens up to `SHARED_PREFIX_TOKENS` past what it reuses: requests with the same key would share
        that many more once one of them is cached. None where it could not reuse them."""
        end = row.reused + SHARED_PREFIX_TOKENS
        if self.prefix.max_tokens <= 0 or _wants_input(request) or self._routes(request) or len(row.tokens) <= end:
            return None
        return tuple(row.tokens[:end])

    def _prefill(self, batch: list[tuple[Request, PrefillRow]], shared: Collection[int] = ()) -> None:
        """Prefill the batch, sample each row's first token; rows in `shared` leave their prompt's KV in the
        prefix cache."""
        requests = [request for request, _ in batch]
        for request, row in batch:
            if request._generator is None and not request.sampling.greedy:
                seed = request.sampling.sampling_seed
                if seed is None:
                    request._generator = self._generator
                else:
                    request._generator = torch.Generator(device=self.model.device).manual_seed(seed)
            if not request.output_ids:
                request.cached_tokens = row.reused
        want_input = _wants_input(requests[0])
        routing = any(self._routes(r) for r in requests)
        logits, layers, routed = self._run_prefill([row for _, row in batch], want_input, routing)
        if routed is not None:
            for (request, row), ids in zip(batch, routed, strict=True):
                if self._routes(request):  # a re-prefill (after a retract) recomputes every recorded position
                    request.routed = [ids[request.routed_experts_start_len - row.reused :]]
        if want_input:
            self._record_input_logprobs(requests[0], logits[0])
            logits = logits[:, -1, :]
        sampled = [i for i, r in enumerate(requests) if r.sampling.max_new_tokens > 0]
        for i, request in enumerate(requests):
            if i not in sampled:
                self._finish(request, {"type": "length", "length": 0})
        if sampled:
            self._sample_and_check([requests[i] for i in sampled], logits[sampled])
        for i in sampled:
            if requests[i].finished or i in shared:
                self._store_prefix(requests[i], [(k.clone(), v.clone()) for k, v in layers[i]])
            if not requests[i].finished:
                self._kv.insert(layers[i])
                self._running.append(requests[i])

    def _run_prefill(
        self, rows: list[PrefillRow], all_logits: bool, routing: bool
    ) -> tuple[torch.Tensor, list[LayerKV], list[torch.Tensor] | None]:
        """`run_prefill` of the rows, in consecutive groups of at most `CPU_PREFILL_FORWARD_TOKENS` padded new
        tokens on CPU (one forward elsewhere); each row gets what one forward gives it, to rounding."""
        if all_logits or self.model.device.type != "cpu":  # all_logits: one row (`_admit`)
            return run_prefill(self.model, rows, all_logits=all_logits, routing=routing)
        logits, layers, routed = [], [], []
        for group in _forward_groups(rows, CPU_PREFILL_FORWARD_TOKENS):
            group_logits, group_layers, group_routed = run_prefill(self.model, group, routing=routing)
            logits.append(group_logits)
            layers.extend(group_layers)
            routed.extend(group_routed or [])
        return torch.cat(logits), layers, routed if routing else None

    def _decode(self) -> None:
        running = self._running
        cache, mask = self._kv.begin_step()
        device = self.model.device
        input_ids = torch.tensor([[r.output_ids[-1]] for r in running], device=device)
        positions = torch.tensor([[n] for n in self._kv.lengths], device=device)
        routing = any(self._routes(r) for r in running)
        out = self.model.forward(input_ids, positions, cache, attention_mask=mask, routing=routing)
        logits, routed = out if isinstance(out, tuple) else (out, None)  # a tuple exactly when `routing`
        if routed is not None:
            for row, request in enumerate(running):
                if self._routes(request):
                    request.routed.append(routed[row])
        self._kv.end_step()
        self.decode_steps += 1
        self._sample_and_check(running, logits)
        for row in reversed(range(len(running))):
            if running[row].finished:
                self._store_prefix(running[row], self._kv.row_kv(row))
                self._remove_row(row)

    def _sample_and_check(self, requests: list[Request], logits: torch.Tensor) -> None:
        rows = [SampleRow(r.sampling, r.output_ids, r._generator, self._banned(r), r.grammar) for r in requests]
        top_k = max(r.top_logprobs_num if r.return_logprob else 0 for r in requests)
        out = sample(logits, rows, top_k)
        if len(out.failed) < len(requests):  # progress means tokens, not forwards: a failing sampler is not alive
            self.last_progress = time.perf_counter()
        for i, request in enumerate(requests):
            if i in out.failed:  # this request's own settings failed: it ends alone, the batch goes on
                log.error("sampling failed for request %s: %r", request.rid, out.failed[i])
                self._finish(request, _engine_error(out.failed[i]))
                continue
            try:
                self._take_token(request, i, out)
            except Exception as e:
                log.exception("finishing a step failed for request %s", request.rid)
                if not request.finished:
                    self._finish(request, _engine_error(e))

    def _take_token(self, request: Request, row: int, out: Sampled) -> None:
        if request.grammar is not None and not request.grammar.accept_token(out.tokens[row]):
            message = f"Grammar accept_token failed: token {out.tokens[row]} is not allowed"
            self._finish(request, _abort_reason(message, 500, "InternalServerError"))
            return
        request.output_ids.append(out.tokens[row])
        request.output_logprobs.append(out.logprobs[row])
        if request.return_logprob and request.top_logprobs_num:
            request.output_top_logprobs.append(_top_pairs(out.top, row, request.top_logprobs_num))
        reason = self._finish_reason(request)
        if reason is not None:
            self._finish(request, reason)
        elif request.on_token is not None:
            request.on_token(request)

    def _banned(self, request: Request) -> tuple[int, ...]:
        spec = request.sampling
        if len(request.output_ids) >= spec.min_new_tokens:
            return ()
        # As SGLang's min_new_tokens penalizer: EOS and the stop ids are held back whatever `ignore_eos` says.
        return tuple(sorted(set(self.model.spec.eos_token_ids) | spec.stop_token_ids))

    def _finish_reason(self, request: Request) -> dict[str, Any] | None:
        spec, token = request.sampling, request.output_ids[-1]
        if len(request.output_ids) >= spec.max_new_tokens:
            return {"type": "length", "length": spec.max_new_tokens}
        if len(request.input_ids) + len(request.output_ids) >= self.model.spec.context_length:
            return {"type": "length", "length": len(request.output_ids)}
        # `ignore_eos` ends no request on a token, neither EOS nor a stop id (SGLang 0.5.23's token-based finish).
        if not spec.ignore_eos and (token in spec.stop_token_ids or token in self.model.spec.eos_token_ids):
            return {"type": "stop", "matched": token}
        if spec.stop and self.model.tokenizer is not None:
            longest = max(len(s) for s in spec.stop)
            tail = self.model.decode(request.output_ids[-(longest + 8) :], spec.skip_special_tokens)
            for stop in spec.stop:
                if stop in tail:
                    request.matched_stop_text = stop
                    return {"type": "stop", "matched": stop}
        if request.grammar is not None and request.grammar.is_terminated():  # SGLang: after the other checks
            return {"type": "stop", "matched": token}
        return None

    def _finish(self, request: Request, reason: dict[str, Any]) -> None:
        if self._routes(request) and request.routed:  # SGLang returns positions start … prompt + output - 2
            rows = len(request.input_ids) + len(request.output_ids) - 1 - request.routed_experts_start_len
            request.routed = [torch.cat(request.routed)[: max(rows, 0)]]
        request.finish_reason = reason
        request.weight_version = self.weight_version
        request.finished_at = time.perf_counter()
        if request.on_finish is not None:
            request.on_finish(request)

    def _store_prefix(self, request: Request, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Offer a sequence's KV (a finished one's, or a prompt others wait to reuse; it covers the first len(KV)
        of prompt + output) to the prefix cache."""
        if self.prefix.max_tokens > 0:
            length = layers[0][0].shape[-2]
            self.prefix.store((request.input_ids + request.output_ids)[:length], layers)

    def _remove_row(self, row: int) -> None:
        moved = self._kv.remove(row)
        if moved is not None:
            self._running[row] = self._running[moved]
        self._running.pop()

    def _record_input_logprobs(self, request: Request, logits: torch.Tensor) -> None:
        """Log-probs of prompt tokens from `logprob_start_len` on; the first prompt token has none."""
        logprobs = torch.log_softmax(logits, dim=-1)  # [L, V]: row i predicts token i + 1
        ids = torch.tensor(request.input_ids, device=logits.device)
        start = min(request.logprob_start_len, len(ids))
        values: list[float | None] = [None] if start == 0 else []
        lo = max(start, 1)
        values += logprobs[lo - 1 : len(ids) - 1].gather(1, ids[lo:].unsqueeze(1)).squeeze(1).tolist()
        request.input_logprobs = values
        if request.top_logprobs_num:
            top = logprobs[lo - 1 : len(ids) - 1].topk(request.top_logprobs_num, dim=-1)
            request.input_top_logprobs = [None] * (1 if start == 0 else 0) + [
                _top_pairs(top, i, request.top_logprobs_num) for i in range(len(ids) - lo)
            ]


def _forward_groups(rows: list[PrefillRow], max_tokens: int) -> list[list[PrefillRow]]:
    """`rows` in order, cut into groups whose padded new tokens (rows x the longest new part) stay within
    `max_tokens`; a row longer than that forms a group alone."""
    groups: list[list[PrefillRow]] = []
    longest = 0
    for row in rows:
        new = len(row.tokens) - row.reused
        if groups and max(longest, new) * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(row)
            longest = max(longest, new)
        else:
            groups.append([row])
            longest = new
    return groups


def _top_pairs(top: Any, row: int, k: int) -> list[tuple[float, int]]:
    return list(zip(top.values[row, :k].tolist(), top.indices[row, :k].tolist(), strict=True))


def _wants_input(request: Request) -> bool:
    """Prompt log-probs requested (and not yet computed)."""
    return request.return_logprob and request.logprob_start_len >= 0 and not request.output_ids


def engine_failed(request: Request) -> bool:
    """Whether the engine itself ended `request` (an exception in a forward or in sampling), not a caller."""
    reason = request.finish_reason or {}
    return reason.get("type") == "abort" and reason.get("status_code") == 500


def _engine_error(e: Exception) -> dict[str, Any]:
    return _abort_reason(f"engine error: {e}", 500, type(e).__name__)


def _abort_reason(message: str, status_code: int | None = None, err_type: str | None = None) -> dict[str, Any]:
    """SGLang's abort finish reason."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
