"""The real `sglang-router` in front of the engines (`rollout.router: sglang`), for generation traffic only.

It runs from SGLang's interpreter (`rollout.sglang.python`; `sglang-router` 0.3.2 is pinned in .venv-sglang) with
the engines' URLs as workers. What it does not forward (0.3.2): `/model_info`, `/server_info`, pause, memory and
weight-update endpoints answer 404 there, so every control call keeps going to each engine directly; only
`/flush_cache` fans out. It registers workers asynchronously (probing gRPC first, then HTTP), so `launch_router`
waits until every worker is listed.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from userrl_megatron.config.schema import SGLangConfig
from userrl_megatron.rollout.engine import EngineError
from userrl_megatron.rollout.launch import ServerProcess, launch_server, watched
from userrl_megatron.rollout.sglang import sglang_python

ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "power_of_two")


def router_command(
    cfg: SGLangConfig, worker_urls: list[str], port: int, prometheus_port: int, policy: str = "round_robin"
) -> list[str]:
    """`python -m sglang_router.launch_router ...` on loopback (a second router on a host needs its own
    Prometheus port: the default 29000 would clash)."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
    if not worker_urls:
        raise ValueError("the router needs at least one worker")
    return [
        sglang_python(cfg), "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--prometheus-port", str(prometheus_port),
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
) -> ServerProcess:
    """Start the router and wait until it answers and lists every worker."""
    command = router_command(cfg, worker_urls, port, prometheus_port, policy)
    router = launch_server(watched(command), f"http://127.0.0.1:{port}", timeout_s, log_path, health_path="/health")
    deadline = time.monotonic() + timeout_s
    while len(list_workers(router.url)) < len(worker_urls):
        if not router.alive() or time.monotonic() >= deadline:
            router.stop(timeout_s=10)
            raise EngineError(f"sglang-router did not register {len(worker_urls)} workers:\n{router.log_tail()}")
        time.sleep(0.5)
    return router


def list_workers(router_url: str) -> list[dict]:
    """The router's registered workers (`GET /workers`); [] while it cannot answer."""
    try:
        with urllib.request.urlopen(router_url + "/workers", timeout=10) as response:
            return list(json.loads(response.read()).get("workers", []))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return []


async def wait_workers(router_url: str, count: int, timeout_s: float) -> None:
    """Async variant of the registration wait (for callers inside an event loop)."""
    deadline = time.monotonic() + timeout_s
    while len(await asyncio.to_thread(list_workers, router_url)) < count:
        if time.monotonic() >= deadline:
            raise EngineError(f"sglang-router at {router_url} lists fewer than {count} workers")
        await asyncio.sleep(0.5)


def replace_worker(router_url: str, old_url: str, new_url: str) -> None:
    """Register `new_url` (`POST /workers`) and remove the worker at `old_url` (`DELETE /workers/{id}`)."""
    body = json.dumps({"url": new_url, "worker_type": "regular"}).encode()
    request = urllib.request.Request(router_url + "/workers", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30):
        pass
    for worker in list_workers(router_url):
        if worker.get("url") == old_url:
            delete = urllib.request.Request(f"{router_url}/workers/{worker['id']}", method="DELETE")
            with urllib.request.urlopen(delete, timeout=30):
                pass
