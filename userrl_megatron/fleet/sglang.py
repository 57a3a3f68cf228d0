"""Launching real SGLang servers from config; the wait-for-health path is `launch.launch_server`.

SGLang runs in the interpreter `sglang_python` picks: `rollout.sglang.python`, else on CPU the project's
`.venv-sglang` built by `make sglang` (so the trainer's environment never needs sglang or its CUDA-pinned torch),
else the trainer's own. On CPU the server needs `SGLANG_USE_CPU_ENGINE=1` and `--device cpu`; the memory saver
(CUDA only) is left off there.

On GPUs each server process sees exactly its own GPUs (`CUDA_VISIBLE_DEVICES` = the engine's GPU ids on that
node, whatever its Ray actor was given) and is told `--base-gpu-id 0`. An engine wider than a node runs one
process per node (`NodeSpan`: `--nnodes`, `--node-rank`, `--dist-init-addr` of node rank 0); only node rank 0
serves HTTP.
"""

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from userrl_megatron.config.schema import SGLangConfig
from userrl_megatron.cores import cpu_list, split_cores, usable_cores
from userrl_megatron.fleet.auth import DEFAULT_KEY_ENV, key_handover
from userrl_megatron.fleet.launch import ProcessLaunch, ServerProcess, connect_host, run_launch, start_process

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV_PYTHON = PROJECT_ROOT / ".venv-sglang" / "bin" / "python"
KEY_ENTRY = Path(__file__).with_name("key_entry.py")  # runs a module with `--api-key` taken from the environment
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
GRAPH_RELEASE_ENV = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}  # CUDA graphs in the memory saver's region (slime sets it)
OMP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # the cores of each TP rank on CPU, "0-3|4-7"


@dataclass(frozen=True)
class NodeSpan:
    """One node's process of an engine that spans `nnodes` nodes (SGLang's multi-node tensor parallelism)."""

    nnodes: int
    node_rank: int
    dist_init_addr: str  # host:port of node rank 0's torch.distributed rendezvous


def sglang_python(cfg: SGLangConfig, device: str) -> str:
    """The interpreter that runs a server on `device` (or the router, which needs no GPU: "cpu"): `cfg.python`;
    else on CPU `.venv-sglang/bin/python` if present; else this one. The project's `.venv-sglang` is a CPU build
    (`make sglang`: SGLang without its CUDA dependencies, a stand-in `sgl_kernel`), never the default for engines
    on GPUs: there SGLang beside the trainer (`pip install -e .[sglang]`) or `cfg.python` serves
    (`fleet/gpu_preflight.py` checks that interpreter before anything starts)."""
    if cfg.python:
        return cfg.python
    if device == "cpu" and SGLANG_VENV_PYTHON.is_file():
        return str(SGLANG_VENV_PYTHON)
    return sys.executable


def resolve_device(cfg: SGLangConfig, has_gpu: bool) -> str:
    """ "auto" -> "cuda" when the engine was given a GPU, else "cpu"."""
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"rollout.sglang.device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.device == "auto":
        return "cuda" if has_gpu else "cpu"
    return cfg.device


def releases_cuda_graphs(cfg: SGLangConfig, colocated: bool, device: str = "cuda") -> bool:
    """Whether a release of "cuda_graph" frees the engine's CUDA-graph pool. SGLang 0.5.23 captures its graphs in
    the memory saver's region only with `SGLANG_MEMORY_SAVER_CUDA_GRAPH` set and the memory saver on
    (model_executor/runner_backend/full_cuda_graph_backend.py:121-124, 185-195); otherwise the release pauses an
    empty region (managers/scheduler_components/weight_updater.py:376-377) and the pool stays for the engine's
    life. With it set, the prefill graphs (breakable by default on CUDA, model_executor/cuda_graph_config.py:119-123)
    must be off (`--disable-prefill-cuda-graph`, arg_groups/fields/exec_.py:662-665): their backend refuses the
    memory saver (runner_backend/breakable_cuda_graph_backend.py:84-95). Asked for with
    `rollout.sglang.release_cuda_graph`, for engines colocated on CUDA."""
    return cfg.release_cuda_graph and cfg.enable_memory_saver and colocated and device != "cpu"


def sglang_command(
    cfg: SGLangConfig,
    model_path: str,
    tp_size: int,
    port: int,
    dtype: str = "auto",
    base_gpu_id: int = 0,
    served_model_name: str = "",
    python: str | None = None,
    device: str = "cuda",
    colocated: bool = False,
    span: NodeSpan | None = None,
    api_key_env: str = "",
    nccl_port: int = 0,
) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine (one node's process of it with `span`);
    `cfg.extra_args` come last, verbatim. The memory saver (torch_memory_saver) is asked for only when the
    engine is `colocated` with the actor on CUDA: it is what lets the engine release its memory to it. With
    `api_key_env` SGLang gets `--api-key` from that environment variable, through `key_entry.py`; with `nccl_port`
    its torch.distributed rendezvous port (`fleet/engine_ports.py`: else SGLang draws one itself)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if span is not None and (span.nnodes < 1 or tp_size % span.nnodes or not 0 <= span.node_rank < span.nnodes):
        raise ValueError(f"tp_size {tp_size} cannot span {span.nnodes} nodes as node rank {span.node_rank}")
    start = ["-m", "sglang.launch_server"] if not api_key_env else [str(KEY_ENTRY), api_key_env, "sglang.launch_server"]
    command = [
        python or sglang_python(cfg, device), *start,
        "--model-path", model_path,
        *(["--served-model-name", served_model_name] if served_model_name else []),
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--dtype", dtype,
    ]  # fmt: skip
    if nccl_port:
        command += ["--nccl-port", str(nccl_port)]
    if device == "cpu":
        command += ["--device", "cpu"]
    else:
        command += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--base-gpu-id", str(base_gpu_id)]
    if span is not None and span.nnodes > 1:
        command += ["--nnodes", str(span.nnodes), "--node-rank", str(span.node_rank)]
        command += ["--dist-init-addr", span.dist_init_addr]
    command.append("--skip-server-warmup")
    if cfg.max_total_tokens:
        command += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.context_length:
        command += ["--context-length", str(cfg.context_length)]
    if cfg.enable_memory_saver and colocated and device != "cpu":  # torch-memory-saver frees CUDA memory only
        command.append("--enable-memory-saver")
    if releases_cuda_graphs(cfg, colocated, device):
        command.append("--disable-prefill-cuda-graph")
    if cfg.enable_weights_cpu_backup:
        command.append("--enable-weights-cpu-backup")
    if cfg.enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if cfg.constrained_json_disable_any_whitespace:
        command.append("--constrained-json-disable-any-whitespace")
    if cfg.constrained_json_max_whitespace_cnt:
        command += ["--constrained-json-max-whitespace-cnt", str(cfg.constrained_json_max_whitespace_cnt)]
    return command + list(cfg.extra_args)


def sglang_env(device: str, gpus: Sequence[str] = (), tp_size: int = 1) -> dict[str, str]:
    """Environment additions of the server process: on CUDA with `gpus` given, exactly those GPUs visible. On
    CPU, SGLang binds each TP rank's threads to the cores of one NUMA node unless `SGLANG_CPU_OMP_THREADS_BIND`
    names them; this names the cores this process may use (`cores.usable_cores`: a SLURM or container cpuset,
    `taskset`), split among the ranks, unless the variable is already set."""
    if device == "cpu":
        env = dict(CPU_ENV)
        if OMP_BIND_ENV not in os.environ:
            env[OMP_BIND_ENV] = "|".join(cpu_list(share) for share in split_cores(usable_cores(), tp_size))
        return env
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}


def sglang_launch(
    cfg: SGLangConfig,
    model_path: str,
    tp_size: int,
    port: int,
    dtype: str = "auto",
    device: str = "cuda",
    gpus: Sequence[str] = (),
    colocated: bool = False,
    span: NodeSpan | None = None,
    node_ip: str = "127.0.0.1",
    served_model_name: str = "",
    base_gpu_id: int = 0,
    api_key: str = "",
    api_key_env: str = DEFAULT_KEY_ENV,
    nccl_port: int = 0,
) -> ProcessLaunch:
    """What one engine process runs (under the watchdog: it stops with the process that started it), with
    `gpus` (its GPU ids on this node) visible and counted from 0, and the URL the driver reaches it at (none
    on node ranks after 0); requiring `api_key` (if given), which it gets in the variable `api_key_env`; its
    rendezvous at `nccl_port` (0: SGLang picks)."""
    per_node = tp_size // (span.nnodes if span else 1)
    if gpus:
        if len(gpus) != per_node:
            raise ValueError(f"an engine process of tp_size {tp_size} on one node needs {per_node} GPUs, got {gpus}")
        base_gpu_id = 0  # the process sees its own GPUs only
    key_env, secrets = key_handover(api_key, api_key_env)
    command = sglang_command(
        cfg, model_path, tp_size, port, dtype, base_gpu_id, served_model_name, device=device, colocated=colocated,
        span=span, api_key_env=key_env, nccl_port=nccl_port,
    )  # fmt: skip
    leader = span is None or span.node_rank == 0
    url = f"http://{connect_host(cfg.host, node_ip)}:{port}" if leader else ""
    env = sglang_env(device, gpus, per_node)
    if releases_cuda_graphs(cfg, colocated, device):
        env |= GRAPH_RELEASE_ENV
    return ProcessLaunch(command, env, url, watch=True, secrets=secrets)


def launch_sglang(
    cfg: SGLangConfig,
    model_path: str,
    tp_size: int,
    port: int,
    dtype: str = "auto",
    base_gpu_id: int = 0,
    log_path: Path | None = None,
    device: str = "cuda",
    served_model_name: str = "",
    colocated: bool = False,
    gpus: Sequence[str] = (),
    span: NodeSpan | None = None,
    node_ip: str = "127.0.0.1",
    api_key: str = "",
    api_key_env: str = DEFAULT_KEY_ENV,
) -> ServerProcess:
    """Start one SGLang server and wait until `/health_generate` answers 200 (node rank 0), or start one later
    node's process of a multi-node engine without waiting (it serves nothing; node rank 0's health covers it).
    With `api_key` it requires that key (handed over in the variable `api_key_env`, default the run's)."""
    launch = sglang_launch(
        cfg, model_path, tp_size, port, dtype, device, gpus, colocated, span, node_ip, served_model_name, base_gpu_id,
        api_key, api_key_env,
    )  # fmt: skip
    if not launch.url:
        return start_process(launch, log_path)
    return run_launch(launch, cfg.startup_timeout_s, log_path)
