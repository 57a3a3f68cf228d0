"""What the GPU check's phases share (`tools/gpu_phases.py`): the sizes per device kind, a phase's record, the
state the phases hand on (`Smoke`) and small helpers (building the actor, transformers' log-probs, versions)."""

import contextlib
import dataclasses
import random
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # imported from `tools/gpu_check.py`: the project and tests/support from the checkout
    sys.path.insert(0, str(REPO))

GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """What the phases build and run on one device kind."""

    model: dict[str, Any]  # Qwen3 config fields (tests/support/tiny_models.tiny_config overrides)
    dtype: str  # the training and serving dtype
    logprob_lengths: tuple[int, ...]  # sequences of the fp32 comparison
    fp32_tolerance: float  # max |actor - transformers| of an fp32 log-prob
    episodes: int  # training batch: episodes of seq_len tokens
    seq_len: int
    micro_batch_tokens: int
    lr: float  # large enough that two steps change the weights the sync carries
    prompt_len: int  # engine requests
    new_tokens: int
    concurrent: int  # requests in flight for the throughput figure
    concurrent_new_tokens: int
    mismatch_requests: int
    mismatch_new_tokens: int
    read_rows: int  # rows of every tensor read back after the sync
    simulator_schemas: int  # reply schemas the simulator engine answers (0: every one the gyms state)
    simulator_max_tokens: int  # each reply's token limit (the grammar must end it first)
    largest: tuple[tuple[str, dict[str, Any]], ...]  # train_largest's candidates, smallest first: (name, config)
    budget_s: dict[str, float]  # per phase
    total_budget_s: float  # no phase starts after this
    between_phases_s: float  # longest silence of the smoke process outside a phase (its start-up: imports)


QWEN3_03B = dict(  # Qwen3-0.6B's widths and vocabulary with 10 layers: 0.31B parameters (tied embeddings)
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
QWEN3_WIDTHS = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=4096)
QWEN3_LARGEST = (  # Qwen3-1.7B, -4B and -8B's shapes, random
    ("qwen3-1.7b", dict(QWEN3_WIDTHS, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                        num_attention_heads=16, tie_word_embeddings=True)),
    ("qwen3-4b", dict(QWEN3_WIDTHS, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, tie_word_embeddings=True)),
    ("qwen3-8b", dict(QWEN3_WIDTHS, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, tie_word_embeddings=False)),
)  # fmt: skip
QWEN3_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)

SIZES = {
    "cuda": Sizes(
        model=QWEN3_03B,
        dtype="bfloat16",
        logprob_lengths=(512, 300, 97, 1024),
        fp32_tolerance=1e-3,
        episodes=16,
        seq_len=2048,  # 32,768 tokens a step
        micro_batch_tokens=8192,
        lr=1e-3,
        prompt_len=64,
        new_tokens=32,
        concurrent=32,
        concurrent_new_tokens=256,
        mismatch_requests=4,
        mismatch_new_tokens=64,
        read_rows=4,
        simulator_schemas=0,
        simulator_max_tokens=1024,
        largest=QWEN3_LARGEST,
        budget_s=dict(
            environment=30,
            model=60,
            plan=60,
            actor_vs_hf_fp32=90,
            train=90,
            offload=30,
            engine_start=120,
            weight_sync=60,
            engine_requests=45,
            logprob_mismatch=30,
            throughput=60,
            release_resume=45,
            simulator_schema=90,
            train_largest=120,
            tests_gpu=240,
        ),
        total_budget_s=480,
        between_phases_s=120,
    ),
    "cpu": Sizes(
        model=QWEN3_TINY,
        dtype="float32",
        logprob_lengths=(40, 17, 63),
        fp32_tolerance=1e-4,
        episodes=4,
        seq_len=48,
        micro_batch_tokens=128,
        lr=1e-3,
        prompt_len=12,
        new_tokens=6,
        concurrent=4,
        concurrent_new_tokens=8,
        mismatch_requests=2,
        mismatch_new_tokens=8,
        read_rows=4,
        simulator_schemas=2,
        simulator_max_tokens=512,
        largest=(("tiny", QWEN3_TINY), ("tiny-4-layers", dict(QWEN3_TINY, num_hidden_layers=4))),
        # The CPU run (CI, tests/unit/test_gpu_check.py) shares its cores with other work and spends no lent device
        # time: its bounds are for a hang only. Each phase took 0-11 s on 2 cores, the whole check about 45 s.
        budget_s=dict(
            environment=600,
            model=600,
            plan=600,
            actor_vs_hf_fp32=600,
            train=600,
            offload=600,
            engine_start=600,
            weight_sync=600,
            engine_requests=600,
            logprob_mismatch=600,
            throughput=600,
            release_resume=600,
            simulator_schema=600,
            train_largest=600,
            tests_gpu=600,
        ),
        total_budget_s=3600,
        between_phases_s=600,
    ),
}


@dataclass(frozen=True)
class Phase:
    """One step of the smoke sequence: its name, what it needs from earlier phases, and its function."""

    name: str
    needs: tuple[str, ...]  # Smoke attributes an earlier phase sets
    run: Callable[["Smoke", "Record"], None]


@dataclass
class Record:
    """A phase's outcome: checks (each true or false, with a detail), figures, and what went wrong."""

    name: str
    budget_s: float = 0.0
    status: str = "skipped"  # passed, failed (a check), error (an exception), timeout, skipped
    seconds: float = 0.0
    summary: str = ""  # one line for the table
    checks: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    reason: str = ""  # why it was skipped or stopped

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a check; returns `ok`."""
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def figure(self, **values: Any) -> None:
        self.figures.update(values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# The smoke sequence (runs in a process of its own)
# ---------------------------------------------------------------------------------------------------------------


class Smoke:
    """State the phases hand on: the model directory, the plan, the actor, the engine server."""

    def __init__(self, device: str, sizes: Sizes, work: Path, engine_log: Path) -> None:
        self.device, self.sizes, self.work, self.engine_log = device, sizes, work, engine_log
        self.model_dir: Path | None = None
        self.arch: Any = None
        self.plan: dict[str, int] | None = None
        self.actor: Any = None  # megatron.actor.MegatronActor: rank 0 of a world of one, in this process
        self.server: Any = None  # fleet.launch.ServerProcess
        self.synced: bool | None = None
        self.port = 0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop(timeout_s=20)
        if self.port:  # build_actor initialized the parallel state
            from userrl_megatron.megatron import parallel

            with contextlib.suppress(Exception):
                parallel.shutdown()

    # ---- helpers ----

    def synchronize(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int | None:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else None

    def device_free(self) -> int | None:
        """Free bytes of the whole device (every process on it), CUDA only."""
        import torch

        return torch.cuda.mem_get_info()[0] if self.cuda else None

    def megatron_config(self) -> Any:
        from userrl_megatron.config.schema import MegatronConfig

        s = self.sizes
        return MegatronConfig(micro_batch_tokens=s.micro_batch_tokens, lr=s.lr, adam_eps=1e-6)

    def layout_overrides(self, model_dir: Path | None = None) -> list[str]:
        """The `userrl plan` overrides of the layout the phases use: one GPU shared by the actor and one
        embedded engine (colocated, tensor-handle sync); the model of the `model` phase unless `model_dir`."""
        s = self.sizes
        device_gb = self._device_gib() if self.cuda else 80.0
        return [
            f"model.path={model_dir or self.model_dir}",
            f"model.dtype={s.dtype}",
            f"megatron.micro_batch_tokens={s.micro_batch_tokens}",
            f"rollout.max_prompt_tokens={s.seq_len // 2}",  # an episode of the training batch's length
            f"rollout.max_response_tokens={s.seq_len - s.seq_len // 2}",
            f"rollout.max_new_tokens_per_turn={s.seq_len - s.seq_len // 2}",
            f"megatron.lr={s.lr}",
            "megatron.offload=true",
            "rollout.backend=embedded",
            "rollout.colocate=true",
            "rollout.num_engines=1",
            "rollout.engine_tp=1",
            "sync.method=tensor",
            f"plan.device_memory_gb={device_gb:.1f}",
        ]

    def _device_gib(self) -> float:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GIB

    def random_prompts(self, count: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(self.arch.vocab_size) for _ in range(length)] for _ in range(count)]

    def actor_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        from userrl_megatron.types import TrainBatch

        return self.actor.compute_logprobs(TrainBatch(seqs, [], []))

    def client(self) -> Any:
        from userrl_megatron.fleet.engine import SGLangClient

        return SGLangClient(self.server.url, timeout_s=300)

    def generate_raw(self, body: dict[str, Any]) -> dict[str, Any]:
        """One `/generate` call with SGLang's full body (penalties, prompt log-probs)."""
        import asyncio

        async def go() -> dict[str, Any]:
            async with self.client() as client:
                status, answer = await client._request("POST", "/generate", body, timeout_s=300)
            if status != 200:
                raise RuntimeError(f"/generate answered HTTP {status}: {answer}")
            return answer

        return asyncio.run(go())


def build_actor(model: Any, smoke: Smoke, load_weights: bool = True) -> Any:
    """A `MegatronActor` as rank 0 of a world of one in this process (as tests/gpu and tests/distributed build it):
    `parallel.initialize` (NCCL on CUDA, gloo and the CPU support on CPU; again: a new layout, same group);
    without `load_weights`, Megatron's random initialisation (a config-only model directory)."""
    from userrl_megatron.config.schema import AlgoConfig
    from userrl_megatron.megatron import cpu, parallel
    from userrl_megatron.ports import free_port

    cpu.stub_missing_kernels()  # megatron.core, imported with the actor, needs it without triton
    from userrl_megatron.megatron.actor import MegatronActor

    if not smoke.port:
        smoke.port = free_port()
    parallel.initialize(smoke.megatron_config(), rank=0, world_size=1, master_port=smoke.port)
    return MegatronActor(model, smoke.megatron_config(), AlgoConfig(), seed=0, load_weights=load_weights)


def train_batch(seqs: list[list[int]]) -> Any:
    from userrl_megatron.types import TrainBatch

    return TrainBatch(seqs, [], [])


def hf_logprobs(model_dir: Path, seqs: list[list[int]], device: str) -> list[list[float]]:
    """transformers' per-token log-probs in fp32 on `device` (position 0 = 0.0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device=device)
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append([0.0, *logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()])
    del model
    return out


def live_at_peak(trace: list[dict[str, Any]], top: int = 12) -> tuple[int, list[tuple[int, str]]]:
    """The most bytes live at once over a CUDA allocator trace (`torch.cuda.memory._snapshot()["device_traces"]`
    of one device, recorded with `_record_memory_history`), and the blocks live then, summed by where they were
    allocated (`allocation_site`), largest first."""
    total = peak = 0
    at = -1
    for i, entry in enumerate(trace):
        total += entry["size"] * {"alloc": 1, "free_completed": -1}.get(entry["action"], 0)
        if total > peak:
            peak, at = total, i
    live: dict[int, dict[str, Any]] = {}
    for entry in trace[: at + 1]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
        elif entry["action"] == "free_completed":
            live.pop(entry["addr"], None)
    sites: dict[str, int] = {}
    for entry in live.values():
        site = allocation_site(entry.get("frames", []))
        sites[site] = sites.get(site, 0) + entry["size"]
    return peak, sorted(((n, site) for site, n in sites.items()), reverse=True)[:top]


def allocation_site(frames: list[dict[str, Any]]) -> str:
    """`path:line function` of the innermost frame in this project or Megatron (paths from the package root)."""
    for frame in frames:
        path = frame["filename"]
        for root in ("userrl_megatron/", "megatron/core/"):
            if root in path:
                return f"{root}{path.rsplit(root, 1)[1]}:{frame['line']} {frame['name']}"
    return "elsewhere"


def row_held(plan: Any, phase: str) -> dict[str, int]:
    rows = [row for row in plan.rows if row.phase == phase]
    return max(rows, key=lambda row: row.used).held if rows else {}


def close_to(value: int, expected: int, tolerance: float) -> bool:
    return expected > 0 and abs(value - expected) <= tolerance * expected


def vs_plan(value: int | None, expected: int) -> str:
    return f"measured {value if value is None else f'{value:,}'} bytes, plan {expected:,}"


def gib(nbytes: float | None) -> str:
    """Bytes as GiB with two decimals, or MiB below 0.1 GiB (the CPU run's sizes)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


def error_record(e: BaseException) -> dict[str, Any]:
    lines = "".join(traceback.format_exception(e)).rstrip().splitlines()
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback": lines[-12:]}


def dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None
