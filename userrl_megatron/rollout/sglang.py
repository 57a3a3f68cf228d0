"""Launching real SGLang servers from config; the wait-for-health path is `launch.launch_server`.

SGLang runs in its own interpreter (`rollout.sglang.python`, by default the project's `.venv-sglang` built by
`make sglang`), so the trainer's environment never needs sglang or its CUDA-pinned torch. On CPU the server
needs `SGLANG_USE_CPU_ENGINE=1` and `--device cpu`; the memory saver (CUDA only) is left off there.
"""

import sys
from pathlib import Path

from userrl_megatron.config.schema import SGLangConfig
from userrl_megatron.rollout.launch import ServerProcess, connect_host, launch_server, watched

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV_PYTHON = PROJECT_ROOT / ".venv-sglang" / "bin" / "python"
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


def sglang_python(cfg: SGLangConfig) -> str:
    """The interpreter that runs the server: `cfg.python`, else `.venv-sglang/bin/python`, else this one."""
    if cfg.python:
        return cfg.python
    return str(SGLANG_VENV_PYTHON) if SGLANG_VENV_PYTHON.is_file() else sys.executable


def resolve_device(cfg: SGLangConfig, has_gpu: bool) -> str:
    """ "auto" -> "cuda" when the engine was given a GPU, else "cpu"."""
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"rollout.sglang.device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.device == "auto":
        return "cuda" if has_gpu else "cpu"
    return cfg.device


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
) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine; `cfg.extra_args` come last, verbatim."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    command = [
        python or sglang_python(cfg), "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--dtype", dtype,
    ]  # fmt: skip
    if device == "cpu":
        command += ["--device", "cpu"]
    else:
        command += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--base-gpu-id", str(base_gpu_id)]
    command.append("--skip-server-warmup")
    if cfg.max_total_tokens:
        command += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.enable_memory_saver and device != "cpu":  # torch-memory-saver frees CUDA memory only
        command.append("--enable-memory-saver")
    if cfg.enable_weights_cpu_backup:
        command.append("--enable-weights-cpu-backup")
    if cfg.enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    return command + list(cfg.extra_args)


def sglang_env(device: str) -> dict[str, str]:
    """Environment additions of the server process."""
    return dict(CPU_ENV) if device == "cpu" else {}


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
) -> ServerProcess:
    """Start one SGLang server and wait until `/health_generate` answers 200."""
    command = sglang_command(cfg, model_path, tp_size, port, dtype, base_gpu_id, served_model_name, device=device)
    url = f"http://{connect_host(cfg.host)}:{port}"
    return launch_server(watched(command), url, cfg.startup_timeout_s, log_path, env=sglang_env(device))
