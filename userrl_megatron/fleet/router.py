"""The real `sglang-router` in front of the engines (`rollout.router: sglang`), for generation traffic only.

It runs from SGLang's interpreter (`rollout.sglang.python`; `sglang-router` 0.3.2 is pinned in .venv-sglang) with
the engines' URLs as workers. What it does not forward (0.3.2): `/model_info`, `/server_info`, pause, memory and
weight-update endpoints answer 404 there, so every control call keeps going to each engine directly; only
`/flush_cache` fans out. It registers workers asynchronously (probing gRPC first, then HTTP), so `launch_router`
waits until every worker is listed.

With an API key (`--api-key`, handed over in an environment variable through `key_entry.py`), the router sends it
to the workers and requires it on generation and on its worker list (`/workers`); it answers `/health` without.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from userrl_megatron.config.schema import SGLangConfig
from userrl_megatron.fleet.auth import DEFAULT_KEY_ENV, key_handover
from userrl_megatron.fleet.launch import ProcessLaunch, ServerProcess, run_launch
from userrl_megatron.fleet.sglang import KEY_ENTRY, sglang_python
from userrl_megatron.wire.generation import EngineError

ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "power_of_two")


def router_command(
    cfg: SGLangConfig,
    worker_urls: list[str],
    port: int,
    prometheus_port: int,
    policy: str = "round_robin",
    api_key_env: str = "",
) -> list[str]:
    """`python -m sglang_router.launch_router ...` on loopback (a second router on a host needs its own
    Prometheus port: the default 29000 would clash); with `api_key_env`, `--api-key` from that variable."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
    if not worker_urls:
        raise ValueError("the router needs at least one worker")
    module = "sglang_router.launch_router"
    start = ["-m", module] if not api_key_env else [str(KEY_ENTRY), api_key_env, module]
    return [
        sglang_python(cfg, "cpu"), *start,  # the router needs no GPU: .venv-sglang has sglang-router too
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--prometheus-port", str(prometheus_port),
        "--prometheus-host", "127.0.0.1",  # its default is every interface
        "--log-level", "warn",
    ]  # fmt: skip


def launch_router(
    cfg: SGLangConfig,
    worker_urls: list[str],
    port: int,
    prometheus_port: int,
    policy: str = "round_robin",
    log_path: Path | None = None,
    timeout_s: float = 120.0,
    api_key: str = "",
    api_key_env: str = DEFAULT_KEY_ENV,
) -> ServerProcess:
    """Start the router (requiring `api_key` and sending it to the workers, if given) and wait until it answers
    and lists every worker."""
    launch = router_launch(cfg, worker_urls, port, prometheus_port, policy, api_key, api_key_env)
    router = run_launch(launch, timeout_s, log_path)
    deadline = time.monotonic() + timeout_s
    while len(list_workers(router.url, api_key)) < len(worker_urls):
        if not router.alive() or time.monotonic() >= deadline:
            router.stop(timeout_s=10)
            raise EngineError(f"sglang-router did not register {len(worker_urls)} workers:\n{router.log_tail()}")
        time.sleep(0.5)
    return router


def router_launch(
    cfg: SGLangConfig,
    worker_urls: list[str],
    port: int,
    prometheus_port: int,
    policy: str = "round_robin",
    api_key: str = "",
    api_key_env: str = DEFAULT_KEY_ENV,
) -> ProcessLaunch:
    """What the router runs (under the watchdog), with the key in its environment."""
    key_env, secrets = key_handover(api_key, api_key_env)
    command = router_command(cfg, worker_urls, port, prometheus_port, policy, key_env)
    return ProcessLaunch(command, {}, f"http://127.0.0.1:{port}", "/health", watch=True, secrets=secrets)


def _request(url: str, api_key: str, data: bytes | None = None, method: str = "GET") -> urllib.request.Request:
    request = urllib.request.Request(url, data=data, method=method)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    return request


def list_workers(router_url: str, api_key: str = "") -> list[dict]:
    """The router's registered workers (`GET /workers`); [] while it cannot answer."""
    try:
        with urllib.request.urlopen(_request(router_url + "/workers", api_key), timeout=10) as response:
            return list(json.loads(response.read()).get("workers", []))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return []


async def wait_workers(router_url: str, count: int, timeout_s: float, api_key: str = "") -> None:
    """Async variant of the registration wait (for callers inside an event loop)."""
    deadline = time.monotonic() + timeout_s
    while len(await asyncio.to_thread(list_workers, router_url, api_key)) < count:
        if time.monotonic() >= deadline:
            raise EngineError(f"sglang-router at {router_url} lists fewer than {count} workers")
        await asyncio.sleep(0.5)


def replace_worker(router_url: str, old_url: str, new_url: str, api_key: str = "") -> None:
    """Register `new_url` (`POST /workers`) and remove the worker at `old_url` (`DELETE /workers/{id}`)."""
    body = json.dumps({"url": new_url, "worker_type": "regular"}).encode()
    request = _request(router_url + "/workers", api_key, body, "POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30):
        pass
    for worker in list_workers(router_url, api_key):
        if worker.get("url") == old_url:
            delete = _request(f"{router_url}/workers/{worker['id']}", api_key, method="DELETE")
            with urllib.request.urlopen(delete, timeout=30):
                pass
