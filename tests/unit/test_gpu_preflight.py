"""The start-up checks of a run on GPUs (`fleet/gpu_preflight.py`), each played with fakes (this machine has no
GPU): the interpreters asked through a fake `probe`, the GPU nodes through a fake `nodes` (items 3 and 5 of issue 56:
a mismatched NCCL, the CPU `.venv-sglang`, an old driver, EXCLUSIVE_PROCESS GPUs and a driver that placed the run
from its own CUDA each failed a run after its start-up, or never started it on GPUs at all)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from userrl_megatron.config.gyms import UserSimConfig, UserSimEnginesConfig
from userrl_megatron.config.schema import RolloutConfig, RootConfig, RunConfig, SGLangConfig
from userrl_megatron.fleet import gpu_preflight, placement, sglang
from userrl_megatron.fleet.gpu_preflight import (
    GpuNode,
    Interpreter,
    PreflightError,
    check_gpu_run,
    gpus_before_ray,
    probe_interpreter,
    read_gpus,
    run_on_gpus,
)

OPT = "/opt/sglang/bin/python"
TRAINER = Interpreter(sys.executable, "2.14.1+cu130", "13.0", "2.27.7", "0.5.23")
SGLANG = Interpreter(OPT, "2.14.1+cu130", "13.0", "2.27.7", "0.5.23")
NODES = [GpuNode("10.0.0.1", "580.95.05", ("Default",) * 8), GpuNode("10.0.0.2", "580.95.05", ("Default",) * 8)]


def config(python: str = OPT, colocate: bool = False, **sync: Any) -> RootConfig:
    cfg = RootConfig()
    rollout = RolloutConfig(backend="sglang", colocate=colocate, sglang=SGLangConfig(python=python))
    return replace(cfg, rollout=rollout, sync=replace(cfg.sync, **sync))


def problems(cfg: RootConfig, *interpreters: Interpreter, nodes: list[GpuNode] = NODES, **kw: Any) -> list[str]:
    """The problems `check_gpu_run` raises, with `interpreters` answering the probe by path."""
    known = {i.python: i for i in (TRAINER, *interpreters)}
    asked: list[str] = []

    def probe(python: str) -> Interpreter:
        asked.append(python)
        return known[python]

    try:
        check_gpu_run(cfg, probe=probe, nodes=lambda: nodes, **kw)
    except PreflightError as e:
        assert str(e) == "\n".join(f"preflight: {p}" for p in e.problems)
        assert all("\n" not in p for p in e.problems)  # one line each
        return e.problems
    finally:
        assert len(asked) == len(set(asked))
    return []


def test_a_matching_run_passes() -> None:
    assert problems(config(), SGLANG) == []
    assert problems(config(python=""), SGLANG) == []  # SGLang beside the trainer: one interpreter


def test_the_broadcast_path_compares_the_nccl_of_both_interpreters() -> None:
    old = replace(SGLANG, nccl="2.26.2", torch="2.13.0+cu128", cuda="12.8")
    [line] = problems(config(), old)
    assert line.startswith(f"NCCL 2.27.7 in the trainer's torch 2.14.1+cu130 ({sys.executable}) and NCCL 2.26.2 in ")
    assert "'Mismatched NCCL version'" in line and line.endswith("or the same torch in both")
    assert problems(config(method="distributed"), old) == [line]
    assert problems(config(colocate=True), old) == []  # tensor handles: no process group with the engines
    assert problems(config(enabled=False), old) == []
    assert problems(config(), old, actors=False) == []  # `userrl rollout`: nothing syncs


def test_the_sglang_interpreter_of_gpu_engines_has_cuda_and_is_not_the_cpu_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / ".venv-sglang" / "bin" / "python"
    venv.parent.mkdir(parents=True)
    venv.touch()
    monkeypatch.setattr(sglang, "SGLANG_VENV_PYTHON", venv)
    # rollout.sglang.python "" on GPUs: the trainer's interpreter is asked, never the CPU .venv-sglang beside it
    assert problems(config(python=""), Interpreter(str(venv), "2.13.0+cpu", cpu_build=True)) == []
    cpu_build = Interpreter(str(venv), "2.13.0+cpu", sglang="0.5.23", cpu_build=True)
    assert problems(config(python=str(venv)), cpu_build) == [
        f"the SGLang interpreter {venv} is the project's CPU build (make sglang): set rollout.sglang.python to an "
        "interpreter with SGLang's CUDA build (docs/install.md, 'On a GPU cluster')"
    ]
    [line] = problems(config(), replace(SGLANG, torch="2.14.1+cpu", cuda="", nccl=""))
    assert line.startswith(f"the SGLang interpreter {OPT} has torch 2.14.1+cpu without CUDA: set rollout.sglang")
    [line] = problems(config(), replace(SGLANG, sglang=""))
    assert line.startswith(f"the SGLang interpreter {OPT} has no sglang: pip install -e .[sglang] beside the trainer")
    [line] = problems(config(), Interpreter(OPT, error="does not run ([Errno 2] No such file)"))
    assert line.startswith(f"the SGLang interpreter {OPT}: does not run ([Errno 2] No such file): set rollout")
    cpu_trainer = Interpreter(sys.executable, "2.13.0+cpu")
    [line] = problems(replace(config(), rollout=RolloutConfig()), cpu_trainer)  # embedded engines
    assert line.startswith(f"the trainer's interpreter {sys.executable}: torch 2.13.0+cpu has no CUDA: create")
    assert problems(config(), SGLANG, cpu_trainer, actors=False) == []  # engines only, in SGLang's interpreter


def test_every_gpu_node_runs_the_driver_the_cuda_of_the_torches_needs() -> None:
    nodes = [NODES[0], GpuNode("10.0.0.2", "570.172.08", ("Default",) * 8)]
    [line] = problems(config(), SGLANG, nodes=nodes)
    assert line == (
        f"node 10.0.0.2 runs NVIDIA driver 570.172.08 and torch 2.14.1+cu130 (CUDA 13.0, {sys.executable}) needs "
        "R580 or later: update the driver, or use a torch built for the CUDA the driver supports (nvidia-smi shows it)"
    )
    cu128 = Interpreter(sys.executable, "2.9.1+cu128", "12.8", "2.27.3", "0.5.4")
    assert problems(config(python=""), cu128, nodes=nodes) == []  # CUDA 12.x runs on R525 and later
    assert problems(config(), SGLANG, nodes=[GpuNode("10.0.0.3")]) == []  # no nvidia-smi nor NVML: unchecked


def test_colocated_runs_need_gpus_in_default_compute_mode() -> None:
    exclusive = [GpuNode("10.0.0.1", "580.95.05", ("Default", "Exclusive_Process"))]
    [line] = problems(config(colocate=True), SGLANG, nodes=exclusive)
    assert line == (
        "node 10.0.0.1: GPU 1 Exclusive_Process: that compute mode refuses a second process on a GPU (colocated "
        "engines share the actor's); set the GPUs to Default (nvidia-smi -c DEFAULT, as root, or the scheduler's "
        "option for it)"
    )
    assert problems(config(), SGLANG, nodes=exclusive) == []  # one process per GPU
    shared_sim = UserSimConfig(engines=UserSimEnginesConfig(model="/models/sim", placement="policy_engines"))
    assert len(problems(replace(config(), user_sim=shared_sim), SGLANG, nodes=exclusive)) == 1
    prohibited = [GpuNode("10.0.0.1", "580.95.05", ("Prohibited",))]
    assert problems(config(), SGLANG, nodes=prohibited)[0].startswith("node 10.0.0.1: GPU 0 Prohibited: that compute")


def test_gpu_placement_comes_from_the_clusters_gpus() -> None:
    assert run_on_gpus("auto", {"CPU": 64.0, "GPU": 16.0}) is True
    assert run_on_gpus("auto", {"CPU": 2.0}) is False
    assert run_on_gpus("cpu", {"GPU": 8.0}) is False
    with pytest.raises(PreflightError, match=r"^preflight: run\.device = cuda and the Ray cluster has no GPUs: "):
        run_on_gpus("cuda", {"CPU": 2.0})
    assert gpus_before_ray(RunConfig(ray_address="10.0.0.1:6379")) is None  # known once joined
    assert gpus_before_ray(RunConfig(device="cpu")) is False


def test_a_driver_without_cuda_places_the_run_on_the_clusters_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's torch has no CUDA; joined to a cluster with GPUs, the run goes on them (the driver decided
    from its own CUDA: `trainer/components.py:122` on dafaaeb)."""
    started: list[Any] = []
    monkeypatch.setattr(placement, "start_ray", lambda run, num_cpus=None: started.append((run, num_cpus)))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 256.0, "GPU": 16.0})
    run = RunConfig(ray_address="10.0.0.1:6379")
    assert placement.start_run_ray(run, 24) is True and started[0][0] is run
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert placement.start_run_ray(RunConfig(), 3) is False and started[1][1] >= 3  # a CPU bundle each


def test_an_interpreter_is_probed_in_a_subprocess() -> None:
    answer = '{"sglang": "0.5.23", "cpu_build": false, "torch": "2.14.1+cu130", "cuda": "13.0", "nccl": "2.27.7"}'

    def run(command: list[str], **kw: Any) -> subprocess.CompletedProcess:
        assert command[:2] == [OPT, "-c"] and kw["timeout"] > 0
        return subprocess.CompletedProcess(command, 0, "some warning\n" + answer + "\n", "")

    assert probe_interpreter(OPT, run) == SGLANG

    def broken(command: list[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(
            command, 1, "", "Traceback ...\nModuleNotFoundError: No module named 'torch'"
        )

    assert probe_interpreter(OPT, broken).error == "cannot import torch (ModuleNotFoundError: No module named 'torch')"
    real = probe_interpreter(sys.executable, subprocess.run)  # this venv: the CPU torch, no sglang
    assert real.torch and real.cuda == "" and real.nccl == "" and real.sglang == "" and not real.error


def test_a_node_reads_its_driver_and_compute_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    smi = "580.95.05, Default\n580.95.05, Exclusive_Process\n"

    def run(command: list[str], **kw: Any) -> subprocess.CompletedProcess:
        assert command == gpu_preflight.SMI
        return subprocess.CompletedProcess(command, 0, smi, "")

    assert read_gpus("n1", run) == GpuNode("n1", "580.95.05", ("Default", "Exclusive_Process"))

    def missing(command: list[str], **kw: Any) -> subprocess.CompletedProcess:
        raise FileNotFoundError("nvidia-smi")

    nvml = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"570.86.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeMode=lambda h: [0, 3][h],
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert read_gpus("n2", missing) == GpuNode("n2", "570.86.15", ("Default", "Exclusive_Process"))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert read_gpus("n3", missing) == GpuNode("n3")
