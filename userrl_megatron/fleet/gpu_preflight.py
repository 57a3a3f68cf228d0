"""What a run on GPUs checks once Ray is up and before any actor or engine starts: each problem is one line that
names the fix, so that a wrong interpreter, driver or GPU setting fails in seconds rather than an hour into a booking.

- **GPU placement** (`run_on_gpus`): whether the run's processes go on GPUs comes from the Ray cluster's GPUs
  (`ray.cluster_resources()`), not from this process's CUDA: the driver may run on a CPU-only head node, or see no
  GPU, while the workers have them.
- **The interpreters** (`interpreter_problems`): the trainer's torch has CUDA; for SGLang engines on GPUs, the
  interpreter that runs them (`fleet.sglang.sglang_python`) has sglang and a torch with CUDA, and is not the
  project's CPU build (`.venv-sglang` from `make sglang`, with tools/sglang_cpu on its path).
- **NCCL** (`nccl_problems`): on the broadcast path (`sync.method` distributed: engines on GPUs of their own) with
  SGLang in another interpreter, both torches carry the same NCCL; otherwise the weight group rendezvouses and its
  first broadcast fails with "Mismatched NCCL version". SGLang 0.5.23 pins torch 2.14.1 (its METADATA).
- **The NVIDIA driver** (`driver_problems`) on every GPU node: at least the branch the CUDA of each interpreter's
  torch needs, by NVIDIA's minor version compatibility (CUDA 13.x: R580, 12.x: R525, 11.x: R450;
  https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html). SGLang 0.5.23's stack is
  CUDA 13 (torch 2.14.1 with `flashinfer_python[cu13]`, `cuda-python>=13.0`, `nvidia-cutlass-dsl[cu13]` in its
  METADATA): R580 or later.
- **Compute mode** (`compute_mode_problems`): every GPU in `Default` mode when processes share GPUs (colocated
  engines, or the user simulator's engines on the policy engines' GPUs): `Exclusive_Process` lets one process use
  a GPU and refuses the next; `Prohibited` refuses every process, shared or not.

The interpreters answer `PROBE` in a subprocess (cached per interpreter); each GPU node answers `nvidia-smi`
(NVML through `pynvml` where nvidia-smi is missing) in a Ray task pinned to it. tests/unit/test_gpu_preflight.py
plays every check with fakes.
"""

import functools
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from userrl_megatron.config.schema import RootConfig, RunConfig
from userrl_megatron.errors import UserError

log = logging.getLogger(__name__)

PROBE = """
import importlib.metadata as md, importlib.util, json
out = {"sglang": "", "cpu_build": importlib.util.find_spec("userrl_sglang_cpu") is not None}
try:
    out["sglang"] = md.version("sglang")
except md.PackageNotFoundError:
    pass
import torch
out |= {"torch": torch.__version__, "cuda": torch.version.cuda or "", "nccl": ""}
if out["cuda"]:
    v = torch.cuda.nccl.version()
    out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
print(json.dumps(out))
"""
PROBE_TIMEOUT_S = 300.0  # a cold `import torch` from a network filesystem can take minutes
DRIVER_BRANCH = {13: 580, 12: 525, 11: 450}  # CUDA major -> the oldest driver branch that runs it
SMI = ["nvidia-smi", "--query-gpu=driver_version,compute_mode", "--format=csv,noheader"]
NVML_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
INSTALL = "docs/install.md, 'On a GPU cluster'"


class PreflightError(UserError):
    """What would fail a run on GPUs after its start-up: one line per problem, each naming its fix."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(f"preflight: {p}" for p in self.problems))


@dataclass(frozen=True)
class Interpreter:
    """What a Python interpreter brings: its torch, torch's CUDA and NCCL, sglang, or why it did not answer."""

    python: str
    torch: str = ""
    cuda: str = ""  # torch.version.cuda; "" for a CPU build
    nccl: str = ""  # torch.cuda.nccl.version(), dotted
    sglang: str = ""  # the installed version; "" when absent
    cpu_build: bool = False  # the project's CPU SGLang (`make sglang`: tools/sglang_cpu on its path)
    error: str = ""  # why the probe failed ("": it answered)


@dataclass(frozen=True)
class GpuNode:
    """One node's NVIDIA driver and the compute mode of each of its GPUs ("" and () where unknown)."""

    node: str
    driver: str = ""
    modes: tuple[str, ...] = ()


Probe = Callable[[str], Interpreter]
Nodes = Callable[[], list[GpuNode]]


def run_on_gpus(device: str, cluster: Mapping[str, float]) -> bool:
    """Whether the run's processes go on GPUs: `run.device` cpu never, cuda always (a cluster without GPUs is an
    error), auto when the Ray cluster has GPUs (`cluster`: `ray.cluster_resources()`)."""
    gpus = cluster.get("GPU", 0.0)
    if device == "cuda" and not gpus:
        raise PreflightError(
            ["run.device = cuda and the Ray cluster has no GPUs: join a cluster with GPUs (run.ray_address) or set "
             "run.device = auto"]
        )  # fmt: skip
    return device != "cpu" and gpus > 0


def gpus_before_ray(run: RunConfig) -> bool | None:
    """Whether the run is on GPUs, as far as this process can tell before Ray is up: never with `run.device` cpu; a
    private Ray has this machine's GPUs (torch's view of them); a joined cluster's (`run.ray_address`) are known only
    once joined (None: `run_on_gpus` decides then, and the config is checked again)."""
    if run.device == "cpu":
        return False
    if run.ray_address:
        return None
    import torch

    return torch.cuda.is_available()


def interpreter_problems(trainer: Interpreter | None, sglang: Interpreter | None) -> list[str]:
    """The trainer's torch has CUDA (None: nothing of the run uses it on GPUs); the SGLang interpreter (None: no
    SGLang engine on GPUs) has sglang and a CUDA torch, and is not the project's CPU build."""
    problems = []
    if trainer is not None and (trainer.error or not trainer.cuda):
        what = trainer.error or f"torch {trainer.torch} has no CUDA"
        problems.append(
            f"the trainer's interpreter {trainer.python}: {what}: create the environment from an interpreter with "
            f"the cluster's CUDA torch ({INSTALL}), or set run.device = cpu"
        )
    if sglang is None:
        return problems
    fix = f"set rollout.sglang.python to an interpreter with SGLang's CUDA build ({INSTALL})"
    if sglang.error:
        problems.append(f"the SGLang interpreter {sglang.python}: {sglang.error}: {fix}")
    elif sglang.cpu_build:
        problems.append(f"the SGLang interpreter {sglang.python} is the project's CPU build (make sglang): {fix}")
    elif not sglang.sglang:
        problems.append(
            f"the SGLang interpreter {sglang.python} has no sglang: pip install -e .[sglang] beside the trainer, or "
            f"{fix}"
        )
    elif not sglang.cuda:
        problems.append(f"the SGLang interpreter {sglang.python} has torch {sglang.torch} without CUDA: {fix}")
    return problems


def nccl_problems(trainer: Interpreter, sglang: Interpreter) -> list[str]:
    """The NCCL of the trainer's torch and of SGLang's, which must be the same to share a process group."""
    if not trainer.nccl or not sglang.nccl or trainer.nccl == sglang.nccl:
        return []
    return [
        f"NCCL {trainer.nccl} in the trainer's torch {trainer.torch} ({trainer.python}) and NCCL {sglang.nccl} in "
        f"SGLang's torch {sglang.torch} ({sglang.python}): the weight broadcast (sync.method distributed) would fail "
        "with 'Mismatched NCCL version'; install the trainer with SGLang's torch (pip install -e .[sglang] in one "
        "environment) or the same torch in both"
    ]


def driver_problems(nodes: Sequence[GpuNode], interpreters: Sequence[Interpreter]) -> list[str]:
    """Every GPU node's driver is at least the branch the CUDA of each interpreter's torch needs."""
    needs = [(DRIVER_BRANCH.get(_major(i.cuda), 0), i) for i in interpreters if i.cuda]
    if not needs:
        return []
    branch, which = max(needs, key=lambda need: need[0])
    problems = []
    for node in nodes:
        if node.driver and _major(node.driver) < branch:
            problems.append(
                f"node {node.node} runs NVIDIA driver {node.driver} and torch {which.torch} (CUDA {which.cuda}, "
                f"{which.python}) needs R{branch} or later: update the driver, or use a torch built for the CUDA "
                "the driver supports (nvidia-smi shows it)"
            )
    return problems


def compute_mode_problems(nodes: Sequence[GpuNode], shared: bool) -> list[str]:
    """GPUs that refuse the run's processes: Prohibited ones always, Exclusive_Process ones when processes share GPUs
    (`shared`: colocated engines, or the simulator's on the policy engines' GPUs)."""
    problems = []
    for node in nodes:
        refused = {"Prohibited"} | ({"Exclusive_Process", "Exclusive_Thread"} if shared else set())
        bad = [f"GPU {i} {mode}" for i, mode in enumerate(node.modes) if mode in refused]
        if bad:
            why = "a second process on a GPU (colocated engines share the actor's)" if shared else "every process"
            problems.append(
                f"node {node.node}: {', '.join(bad)}: that compute mode refuses {why}; set the GPUs to Default "
                "(nvidia-smi -c DEFAULT, as root, or the scheduler's option for it)"
            )
    return problems


def check_gpu_run(
    cfg: RootConfig, actors: bool = True, engines: bool = True, probe: Probe | None = None, nodes: Nodes | None = None
) -> None:
    """Raise PreflightError with every problem of `cfg` on GPUs. `actors`: the run starts actor ranks (and, with
    `engines`, syncs weights into the engines); `engines`: it starts rollout engines (`userrl train`: both; `userrl
    rollout` and `eval`: engines; `userrl sft`: actors). `probe` and `nodes` replace the subprocess and Ray probes in
    tests."""
    probe = probe or interpreter
    nodes = nodes or gpu_nodes
    from userrl_megatron.fleet.sglang import sglang_python

    r, sim = cfg.rollout, cfg.user_sim.engines
    backends = ({r.backend} | ({sim.backend or r.backend} if sim.model else set())) if engines else set()
    sglang_on_gpus = "sglang" in backends and r.sglang.device != "cpu"
    trainer = probe(sys.executable)
    python = sglang_python(r.sglang, "cuda")
    sglang = (trainer if python == sys.executable else probe(python)) if sglang_on_gpus else None
    uses_trainer = actors or "embedded" in backends or sglang is trainer
    problems = interpreter_problems(trainer if uses_trainer else None, sglang)
    if actors and sglang is not None and sglang is not trainer and not problems and _broadcasts(cfg):
        problems += nccl_problems(trainer, sglang)
    found = nodes()
    used = ([trainer] if uses_trainer else []) + ([sglang] if sglang is not None else [])
    problems += driver_problems(found, used)
    shared = engines and ((r.colocate and actors) or (bool(sim.model) and sim.shares_policy_engines))
    problems += compute_mode_problems(found, shared)
    if problems:
        raise PreflightError(problems)
    log.info(
        "preflight: trainer torch %s (CUDA %s, NCCL %s)%s; %d GPU node(s), driver %s",
        trainer.torch, trainer.cuda, trainer.nccl,
        f", SGLang {sglang.sglang} torch {sglang.torch} ({sglang.python})" if sglang is not None else "",
        len(found), ", ".join(sorted({n.driver for n in found if n.driver})) or "unknown",
    )  # fmt: skip


def _broadcasts(cfg: RootConfig) -> bool:
    """Whether the weights reach the engines over a process group (`trainer.weight_sync.WeightSync.method`)."""
    method = cfg.sync.method if cfg.sync.method != "auto" else "tensor" if cfg.rollout.colocate else "distributed"
    return cfg.sync.enabled and method == "distributed"


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


@functools.cache
def interpreter(python: str) -> Interpreter:
    """What `python` brings (`PROBE` run in it once per process)."""
    return probe_interpreter(python, subprocess.run)


def probe_interpreter(python: str, run: Callable[..., Any]) -> Interpreter:
    """`PROBE` run in `python` through `run` (`subprocess.run`'s signature)."""
    try:
        done = run([python, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Interpreter(python, error=f"does not run ({e})")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Interpreter(python, error=f"cannot import torch ({last})")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Interpreter(python, error=f"answered {done.stdout.strip()[:200]!r}")
    return Interpreter(python, found["torch"], found["cuda"], found["nccl"], found["sglang"], bool(found["cpu_build"]))


def read_gpus(node: str, run: Callable[..., Any] = subprocess.run) -> GpuNode:
    """This node's driver and compute modes from nvidia-smi, else from NVML through pynvml, else unknown."""
    try:
        done = run(SMI, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0:
        rows = [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
        return GpuNode(node, rows[0][0] if rows else "", tuple(row[1] for row in rows if len(row) > 1))
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            modes = tuple(NVML_MODES.get(pynvml.nvmlDeviceGetComputeMode(h), "?") for h in handles)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no NVML: nothing to check on this node
        log.warning(
            "preflight: node %s: neither nvidia-smi nor NVML answered (%s); driver and modes unchecked", node, e
        )
        return GpuNode(node)
    return GpuNode(node, driver.decode() if isinstance(driver, bytes) else str(driver), modes)


@functools.cache
def gpu_nodes() -> list[GpuNode]:
    """Every alive GPU node of the Ray cluster, each read on its node (a task pinned there, holding no resource)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0)(read_gpus)
    alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU")]
    return ray.get(
        [
            remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                n["NodeManagerAddress"]
            )
            for n in alive
        ]
    )
