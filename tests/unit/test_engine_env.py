"""What an engine server process gets of its launcher's environment (`fleet/engine_env.py`): the allow-list,
exactly, for an SGLang engine and an embedded engine (item 4 of issue 56: the launcher's whole environment reached
SGLang, a user's `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` and slurm/job_env.sh's
`CUDA_DEVICE_MAX_CONNECTIONS=1` with it)."""

import json
import sys
import time
from pathlib import Path

import pytest

from userrl_megatron.config.schema import EmbeddedServerConfig, SGLangConfig
from userrl_megatron.fleet.engine_env import engine_environment, passes
from userrl_megatron.fleet.launch import ProcessLaunch, embedded_launch, start_process
from userrl_megatron.fleet.sglang import sglang_launch

KEY = "k" * 43
PASSED = {
    "PATH": "/venv/bin:/usr/bin:/bin",
    "HOME": "/home/u",
    "USER": "u",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/scratch/tmp",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "PYTHONPATH": "/src",
    "PYTHONUNBUFFERED": "1",
    "https_proxy": "http://proxy:3128",
    "no_proxy": "localhost,127.0.0.1",
    "HF_HOME": "/data/hf",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "XDG_CACHE_HOME": "/scratch/cache",
    "TRITON_CACHE_DIR": "/scratch/triton",
    "USERRL_CACHE": "/data/userrl",
    "NCCL_SOCKET_IFNAME": "ib0",
    "NCCL_IB_HCA": "mlx5_0",
    "NCCL_CUMEM_ENABLE": "0",
    "GLOO_SOCKET_IFNAME": "ib0",
    "TP_SOCKET_IFNAME": "ib0",
    "CUDA_HOME": "/usr/local/cuda",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "SGLANG_TORCH_PROFILER_DIR": "/scratch/prof",
    "TOKENIZERS_PARALLELISM": "true",
}
DROPPED = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # breaks torch_memory_saver's release
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # slurm/job_env.sh's, for Megatron
    "OMP_NUM_THREADS": "1",  # Ray's, in a one-CPU actor
    "RAY_JOB_ID": "01000000",
    "RAY_RAYLET_PID": "4242",
    "SPT_NOENV": "1",
    "VIRTUAL_ENV": "/venv",
    "SLURM_JOB_ID": "4711",
    "MASTER_PORT": "29500",
    "WANDB_API_KEY": "not-for-engines",
}
LAUNCHER = PASSED | DROPPED | {"CUDA_VISIBLE_DEVICES": "3"}  # Ray's: the actor's one GPU


def test_an_sglang_engine_gets_the_allow_list_its_gpus_and_its_key() -> None:
    launch = sglang_launch(SGLangConfig(python="py"), "/m", 2, 30000, gpus=["2", "3"], api_key=KEY)
    assert engine_environment(LAUNCHER, launch.env, launch.secrets) == PASSED | {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "USERRL_ENGINE_API_KEY": KEY,
    }
    released = SGLangConfig(python="py", release_cuda_graph=True)
    colocated = sglang_launch(released, "/m", 1, 30000, gpus=["0"], colocated=True, api_key=KEY, api_key_env="SIM_KEY")
    assert engine_environment(LAUNCHER, colocated.env, colocated.secrets) == PASSED | {
        "CUDA_VISIBLE_DEVICES": "0",
        "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1",
        "SIM_KEY": KEY,
    }


def test_an_embedded_engine_gets_the_allow_list_and_its_key() -> None:
    launch = embedded_launch("/m", EmbeddedServerConfig(device="cpu"), 31000, api_key=KEY)
    assert engine_environment(LAUNCHER, launch.env, launch.secrets) == PASSED | {
        "CUDA_VISIBLE_DEVICES": "3",
        "USERRL_ENGINE_API_KEY": KEY,
    }


def test_the_rule_per_name() -> None:
    assert all(passes(name) for name in PASSED) and not any(passes(name) for name in DROPPED)
    assert passes("CUDA_VISIBLE_DEVICES") and passes("LC_CTYPE") and not passes("PYTORCH_ALLOC_CONF")


def test_a_started_server_process_gets_exactly_that(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_process` itself: the process sees the allow-listed launcher variables, its own and its secrets."""
    for name, value in DROPPED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    out = tmp_path / "env.json"
    dump = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    launch = ProcessLaunch(
        [sys.executable, "-c", dump, str(out)], {"CUDA_VISIBLE_DEVICES": "1"}, "", secrets={"K": KEY}
    )
    server = start_process(launch, tmp_path / "server.log")
    deadline = time.monotonic() + 60
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.stop() == 0
    env = json.loads(out.read_text())
    assert not set(DROPPED) & set(env)
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["CUDA_VISIBLE_DEVICES"] == "1" and env["K"] == KEY
    assert all(passes(name) or name in ("CUDA_VISIBLE_DEVICES", "K") for name in env)
