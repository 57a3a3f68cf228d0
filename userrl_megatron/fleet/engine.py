"""The rollout-engine interface: token ids in, token ids and their log-probs out.

The method names and payloads are SGLang's native HTTP API (`/generate`, `/init_weights_update_group`,
`/update_weights_from_distributed`, `/flush_cache`, `/pause_generation`, ...), so one client drives real
SGLang servers and the embedded server alike.
"""

import asyncio
import base64
import json
import random
import time
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np

from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError, Generation

# How long one start-up health probe may wait: longer than a server's own health timeout (20 s, SGLang's and the
# embedded server's default), so a server whose forward is slow on a busy machine still answers in time.
HEALTH_PROBE_S = 60.0
# One attempt at reading an engine's weights: a live engine answers, a busy one late (its scheduler first finishes the
# step it is in, on a shared CPU at its share of a core); only a hang waits this long.
READ_TIMEOUT_S = 600.0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the episode runner and the weight sync need from an engine."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        """Continue `input_ids`; the output never includes the input. With `routed_experts_start_len` (MoE
        routing replay) the engine also returns the experts it routed positions start … end − 2 to."""
        ...

    async def health(self) -> bool:
        """True when the engine answers and can generate."""
        ...

    async def flush_cache(self) -> None: ...

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating (SGLang `/pause_generation`): "abort" in-flight requests (they return partial output
        with finish_reason "abort"), "retract" them (recomputed after resume), or freeze them "in_place"."""
        ...

    async def resume(self) -> None:
        """Undo `pause` (SGLang `/continue_generation`)."""
        ...

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None: ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None: ...

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """Load tensors named by handles (one base64 payload per engine TP rank; colocated engines only)."""
        ...

    async def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang 0.5.23 requires one around update_weights_from_distributed)."""
        ...

    async def end_weight_update(self) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang `/release_memory_occupation` (tags: "kv_cache", "weights", "cuda_graph"; None = all)."""
        ...

    async def resume_memory(self, tags: list[str] | None = None) -> None: ...

    async def get_model_info(self) -> dict[str, Any]: ...


class SGLangClient:
    """Async client of SGLang's native HTTP API: drives real SGLang 0.5.x servers and `userrl serve` alike.

    Generation and reads are retried with exponential backoff on connection errors, timeouts and 5xx; a 4xx
    (bad input) fails at once with the server's message. Weight-sync calls are never retried (they pair with
    the trainer's broadcasts) and wait as long as the server needs. Failures raise `EngineError`.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: Any = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._weight_sessions = True  # False once the server showed it predates /begin_weight_update
        self.failures = 0  # calls that failed after their retries

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(
        self, method: str, path: str, payload: Any = None, timeout_s: float | None = None, retries: int | None = None
    ) -> tuple[int, Any]:
        """(status, parsed JSON or text) of one call, retrying transport failures and 5xx."""
        import aiohttp

        if self._session is not None and self._session_loop is not asyncio.get_running_loop():
            self._session = None  # a session belongs to the loop that made it (e.g. successive asyncio.run calls)
        if self._session is None:
            self._session_loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=self._headers, trust_env=False
            )
        retries = self.max_retries if retries is None else retries
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + random.random() * 0.1))
            try:
                async with self._session.request(
                    method, self.base_url + path, json=payload, timeout=timeout
                ) as response:
                    raw = await response.read()
                    body = _parse(raw, response.content_type)
                    if response.status < 500:
                        return response.status, body
                    last = f"HTTP {response.status}: {_message(body)}"
            except (TimeoutError, aiohttp.ClientError) as e:
                last = f"{type(e).__name__}: {e}"
        self.failures += 1
        raise EngineError(f"{method} {self.base_url}{path} failed after {retries + 1} attempts: {last}")

    async def _control(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A `{"success", "message"}` endpoint, not retried, no deadline."""
        status, body = await self._request("POST", path, payload, timeout_s=None, retries=0)
        if status != 200 or not (isinstance(body, dict) and body.get("success", False)):
            raise EngineError(f"{path}: {_message(body)} (HTTP {status})")
        return body

    # ---- generation ----

    def generate_payload(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> dict[str, Any]:
        """The `/generate` body: token ids in, output ids and their log-probs (and routed experts) out."""
        body = {"input_ids": list(input_ids), "sampling_params": sampling.to_dict(), "return_logprob": True}
        if routed_experts_start_len is not None:
            body.update(return_routed_experts=True, routed_experts_start_len=routed_experts_start_len)
        return body

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        payload = self.generate_payload(input_ids, sampling, routed_experts_start_len)
        status, body = await self._request("POST", "/generate", payload, timeout_s=self.timeout_s)
        if status != 200:
            raise EngineError(f"/generate: {_message(body)} (HTTP {status})")
        meta = body["meta_info"]
        routed = None
        aborted = (meta.get("finish_reason") or {}).get("type", "abort") == "abort"
        if routed_experts_start_len is not None and not (aborted and "routed_experts" not in meta):
            rows = len(input_ids) + len(body["output_ids"]) - 1 - routed_experts_start_len
            routed = decode_routed_experts(meta.get("routed_experts"), max(rows, 0))
        return Generation(
            output_ids=list(body["output_ids"]),
            output_logprobs=[float(lp) for lp, _, _ in meta["output_token_logprobs"]],
            finish_reason=(meta.get("finish_reason") or {}).get("type", "abort"),
            weight_version=str(meta.get("weight_version", "default")),
            prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
            latency_s=float(meta.get("e2e_latency", 0.0)),
            routed_experts=routed,
        )

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, timeout_s=30)

    # ---- health and introspection ----

    async def health(self, timeout_s: float = 30.0) -> bool:
        try:
            status, _ = await self._request("GET", "/health_generate", timeout_s=timeout_s, retries=0)
        except EngineError:
            self.failures -= 1  # an unhealthy answer is a result, not a failed call
            return False
        return status == 200

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll `/health_generate` until 200 or raise EngineError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not await self.health(timeout_s=max(poll_s, min(HEALTH_PROBE_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise EngineError(f"{self.base_url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)

    async def get_model_info(self) -> dict[str, Any]:
        status, body = await self._request("GET", "/model_info", timeout_s=30)
        if status == 404:  # SGLang before /model_info
            status, body = await self._request("GET", "/get_model_info", timeout_s=30)
        if status != 200:
            raise EngineError(f"/model_info: {_message(body)} (HTTP {status})")
        return body

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        payload = {"name": name, "truncate_size": truncate_size}
        status, body = await self._request("POST", "/get_weights_by_name", payload, timeout_s=READ_TIMEOUT_S)
        if status != 200:
            raise EngineError(f"/get_weights_by_name: {_message(body)} (HTTP {status})")
        return body

    # ---- cache, pause, memory ----

    async def flush_cache(self, timeout_s: float = 0.0) -> None:
        status, body = await self._request("POST", f"/flush_cache?timeout={timeout_s}", timeout_s=timeout_s + 60)
        if status != 200:
            raise EngineError(f"/flush_cache refused: {_message(body).strip()} (HTTP {status})")

    async def pause(self, mode: str = "abort") -> None:
        status, body = await self._request("POST", "/pause_generation", {"mode": mode}, timeout_s=None)
        if status != 200:
            raise EngineError(f"/pause_generation: {_message(body)} (HTTP {status})")

    async def resume(self) -> None:
        status, body = await self._request("POST", "/continue_generation", {}, timeout_s=60)
        if status != 200:
            raise EngineError(f"/continue_generation: {_message(body)} (HTTP {status})")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self._memory("/release_memory_occupation", tags)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._memory("/resume_memory_occupation", tags)

    async def _memory(self, path: str, tags: list[str] | None) -> None:
        status, body = await self._request("POST", path, {"tags": tags}, timeout_s=None, retries=0)
        if status != 200:
            raise EngineError(f"{path}: {_message(body)} (HTTP {status})")

    # ---- weight sync ----

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Blocks until every rank joined: run it concurrently with the trainer's own group creation."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._control("/init_weights_update_group", payload)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        """Open the session SGLang 0.5.23 requires; a server without the endpoint (older 0.5.x) needs none."""
        if not self._weight_sessions:
            return
        status, body = await self._request("POST", "/begin_weight_update", {}, timeout_s=None, retries=0)
        if status == 404:
            self._weight_sessions = False
            return
        if status != 200 or not body.get("success"):
            raise EngineError(f"/begin_weight_update: {_message(body)} (HTTP {status})")

    async def end_weight_update(self) -> None:
        if self._weight_sessions:
            await self._control("/end_weight_update", {})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None:
        """Answers once the trainer's broadcast(s) for these tensors arrived and were loaded."""
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        await self._control("/update_weights_from_distributed", payload)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """Answers once every TP rank mapped its payload's tensors and loaded them (`wire/handles.py` format)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        await self._control("/update_weights_from_tensor", payload)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        await self._control(
            "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )


def _parse(raw: bytes, content_type: str) -> Any:
    if content_type == "application/json" or raw[:1] in (b"{", b"["):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    return raw.decode(errors="replace")


def _message(body: Any) -> str:
    """The error text of any of SGLang's three error shapes (or plain text)."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        if "message" in body:
            return str(body["message"])
    return str(body)


def decode_routed_experts(encoded: str | None, rows: int) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of int32 [rows, layers, top_k]) as int32 [rows, layers x top_k].

    A missing field means the server records no routing (SGLang without `--enable-return-routed-experts`)."""
    if encoded is None:
        raise EngineError(
            "/generate returned no routed_experts: start the engine with --enable-return-routed-experts "
            "(algo.routing_replay: rollout sets it for engines this project launches)"
        )
    ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if (rows == 0 and ids.size) or (rows and ids.size % rows):
        _bad_routing(ids.size, rows)
    return ids.reshape(rows, -1 if rows else 0).copy()


def _bad_routing(size: int, rows: int) -> NoReturn:
    raise EngineError(f"/generate returned {size} routed expert ids, not a multiple of its {rows} positions")
