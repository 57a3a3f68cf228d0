"""Launching real SGLang servers from config (GPU clusters); the wait-for-health path is `launch.launch_server`."""

import sys
from pathlib import Path

from userrl_megatron.config.schema import SGLangConfig
from userrl_megatron.rollout.launch import ServerProcess, connect_host, launch_server


def sglang_command(
    cfg: SGLangConfig,
    model_path: str,
    tp_size: int,
    port: int,
    dtype: str = "auto",
    base_gpu_id: int = 0,
    served_model_name: str = "",
    python: str = sys.executable,
) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine; `cfg.extra_args` come last, verbatim."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--dtype", dtype,
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--base-gpu-id", str(base_gpu_id),
        "--skip-server-warmup",
    ]  # fmt: skip
    if cfg.enable_memory_saver:
        command.append("--enable-memory-saver")
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    return command + list(cfg.extra_args)


def launch_sglang(
    cfg: SGLangConfig,
    model_path: str,
    tp_size: int,
    port: int,
    dtype: str = "auto",
    base_gpu_id: int = 0,
    log_path: Path | None = None,
) -> ServerProcess:
    """Start one SGLang server and wait until `/health_generate` answers 200."""
    command = sglang_command(cfg, model_path, tp_size, port, dtype, base_gpu_id)
    return launch_server(command, f"http://{connect_host(cfg.host)}:{port}", cfg.startup_timeout_s, log_path)
