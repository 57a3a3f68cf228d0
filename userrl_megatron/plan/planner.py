"""`plan_run(cfg)`: the device memory of every phase of a run, found by playing the trainer's own choreography
(`trainer.components.bring_up`, then two steps of `trainer.driver.Trainer.fit`, with a checkpoint, evaluations
and the final export) on the ledger of `plan/ledger.py`, and the pinned host memory of every node. Nothing is
started: no Ray, no model, no GPU.

For other tools (a GPU check comparing measured memory with the prediction): `plan_run(cfg).phase_bytes()` is
{phase: bytes of its busiest GPU}, `.phase_bytes("actor")` the same over the actor's GPUs only (the
colocated layouts' GPUs are "shared"), and `.host` the bytes of every node.
"""

import asyncio
import logging
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from userrl_megatron.config.model_fit import model_shape
from userrl_megatron.config.resolve import resolve_config
from userrl_megatron.config.schema import RootConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.errors import UserError
from userrl_megatron.plan.ledger import SIMULATOR_TAGS, Ledger, LedgerActors, LedgerPool, LedgerRunner, Restart
from userrl_megatron.plan.memory import (
    GIB,
    actor_memory,
    engine_memory,
    export_working_set,
    host_memory,
    sync_buckets,
)
from userrl_megatron.types import Task

STEPS = 2  # the first step, and one in the steady state (offloads and releases already paired)


@dataclass
class PhaseRow:
    """A phase's busiest GPU among the actor's or the engines' GPUs (one kind when colocated)."""

    phase: str
    kind: str  # "actor", "engine" or "shared"
    device: int
    used: int  # bytes
    held: dict[str, int]  # what holds them


@dataclass
class HostRow:
    """A node's pinned host memory at the end of the run (torch keeps it from its first allocation on)."""

    node: int
    used: int  # bytes
    held: dict[str, int]  # what holds them, summed over the node's processes
    actor_ranks: int  # actor ranks on the node
    engine_gpus: int  # engine GPUs on the node


@dataclass
class MemoryPlan:
    """Per phase and GPU kind, in the order the run reaches the phases; the engines' KV pools; ordering problems;
    the host memory of each node."""

    device_bytes: int
    devices: int
    rows: list[PhaseRow]
    kv_tokens: list[int]  # each engine's KV-cache size in tokens
    kv_demand: int  # tokens the episodes in flight on one engine can reach
    problems: list[str]
    host_bytes: int = 0  # plan.host_memory_gb in bytes
    host: list[HostRow] = field(default_factory=list)
    simulator: list[PhaseRow] = field(default_factory=list)  # the busiest GPU of the user simulator's engines
    simulator_kv_tokens: list[int] = field(default_factory=list)  # each simulator engine's KV cache in tokens
    # On the policy engines' GPUs (user_sim.engines.placement: policy_engines): what a simulator engine holds on each
    # of its GPUs while it serves (in `rows` beside the policy's; `simulator` stays empty).
    simulator_shared: dict[str, int] = field(default_factory=dict)
    # Where the trainer restarts a dead engine, the smallest KV pool one gets ({"engine": ..., "user simulator
    # engine": ...}): it sizes its pool from what its GPUs hold then.
    restarts: dict[str, Restart] = field(default_factory=dict)

    @property
    def peak(self) -> PhaseRow:
        return max(self.rows, key=lambda r: r.used)

    def phase_bytes(self, kind: str | None = None) -> dict[str, int]:
        """{phase: bytes its busiest GPU holds}, over the GPUs of `kind` ("actor", "engine", "shared") or all."""
        out: dict[str, int] = {}
        for row in self.rows:
            if kind is None or row.kind == kind:
                out[row.phase] = max(out.get(row.phase, 0), row.used)
        return out


def plan_run(cfg: RootConfig) -> MemoryPlan:
    """The memory plan of `cfg` on GPUs of `plan.device_memory_gb` (see the module docstring)."""
    from userrl_megatron.fleet.placement import plan_bundles
    from userrl_megatron.fleet.simulator import policy_engine_rollout

    cfg = resolve_config(cfg)  # as the run does before it starts

    config = model_shape(cfg.model.path)
    if config is None:
        raise UserError(
            f"model.path = {cfg.model.path}: no config.json there and not a model whose shape is known here "
            "(configs/model/): the plan needs the model's shape"
        )
    arch = Architecture.from_hf_config(config)
    bundles = plan_bundles(cfg.megatron, cfg.rollout, use_gpu=True)
    ledger = Ledger.of(len(bundles.bundles), int(cfg.plan.device_memory_gb * GIB))
    context = int(cfg.plan.context_gb * GIB)
    engine_devices = [list(range(b, b + cfg.rollout.engine_tp)) for b in bundles.engine_bundles]
    for device in sorted(set(bundles.actor_bundles)) + [d for ds in engine_devices for d in ds]:
        ledger.book(device, "CUDA contexts", context)
    # The run starts the simulator's engines before the actor: on the policy engines' GPUs they are there first.
    shared_sim, sim_kv, sim_held = _shared_simulator(cfg, ledger, engine_devices)

    bucket = cfg.sync.bucket_mb * 2**20
    world = len(bundles.actor_bundles)
    dtype = cfg.model.dtype
    method = cfg.sync.method if cfg.sync.method != "auto" else "tensor" if cfg.rollout.colocate else "distributed"
    actors = LedgerActors(
        ledger,
        actor_memory(arch, cfg.megatron, dtype, world),
        bundles.actor_bundles,
        bucket,
        sync_bytes=sync_buckets(arch, bucket, dtype),
        kept_buckets=method == "distributed",  # the broadcast keeps its buffers; tensor handles free theirs per sync
        export_bytes=export_working_set(arch, cfg.megatron.tensor_model_parallel_size, dtype),
        host=host_memory(arch, cfg.megatron, dtype, world, kl=cfg.algo.kl_coef > 0),
    )
    rollout = policy_engine_rollout(cfg)  # SGLang's fraction counts the simulator's share on shared GPUs
    engine = engine_memory(arch, rollout, dtype, cfg.plan)
    pool = LedgerPool(ledger, engine, rollout, engine_devices)
    tokens = min(cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens, cfg.model.max_context_length)
    runner = LedgerRunner(ledger, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_play(_short_run(cfg, tmp), actors, pool, runner, shared_sim))
    actor_gpus, engine_gpus = set(bundles.actor_bundles), {d for ds in engine_devices for d in ds}
    kinds = {"shared": actor_gpus} if actor_gpus == engine_gpus else {"actor": actor_gpus, "engine": engine_gpus}
    rows = []
    for phase, per_device in ledger.peaks.items():
        for kind, gpus in kinds.items():
            device = max(sorted(gpus), key=lambda d: per_device[d][0])
            rows.append(PhaseRow(phase, kind, device, *per_device[device]))
    episodes = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    in_flight = min(cfg.rollout.max_concurrent_episodes, -(-episodes // cfg.rollout.num_engines))
    weights = dict.fromkeys((d for ds in engine_devices for d in ds), engine.weights)
    backup = {"engine weight backup": weights} if _engine_weight_backup(cfg) else {}
    graphs: dict[int, int] = {}  # SGLang backs up a released graph pool: the policy's, and the simulator's beside it
    for p, runtime in ((pool, engine.runtime), (shared_sim, shared_sim.memory.runtime if shared_sim else 0)):
        if p is not None and p.rollout.colocate and p.rollout.backend == "sglang" and p.frees_graphs:
            for device in (d for ds in p.engine_devices for d in ds):
                graphs[device] = graphs.get(device, 0) + runtime
    if graphs:
        backup["engine CUDA graph backup"] = graphs
    host = _host_rows(cfg, actors.host_held, bundles.actor_bundles, engine_devices, backup)
    simulator, simulator_kv, simulator_problems = _simulator_plan(cfg) if shared_sim is None else ([], sim_kv, [])
    return MemoryPlan(
        ledger.device_bytes,
        len(ledger.held),
        rows,
        pool.kv_tokens,
        in_flight * tokens,
        ledger.problems + simulator_problems,
        int(cfg.plan.host_memory_gb * GIB),
        host,
        simulator,
        simulator_kv,
        sim_held,
        {p.name: p.smallest_restart for p in (pool, shared_sim) if p is not None and p.smallest_restart},
    )


def _shared_simulator(
    cfg: RootConfig, ledger: Ledger, engine_devices: list[list[int]]
) -> tuple[LedgerPool | None, list[int], dict[str, int]]:
    """The user simulator's engines on the policy engines' GPUs (`user_sim.engines.placement: policy_engines`):
    simulator engine e on policy engine e's GPUs, with a CUDA context of its own on each, started on `ledger` (their
    KV pools sized from what is free then); their KV caches in tokens; what one holds on its first GPU once started.
    (None, [], {}) when they have GPUs of their own."""
    from userrl_megatron.fleet.simulator import simulator_restart_rollout, simulator_rollout

    if not cfg.user_sim.engines.shares_policy_engines:
        return None, [], {}
    rollout = simulator_rollout(cfg)
    devices = engine_devices[: rollout.num_engines]
    for device in (d for ds in devices for d in ds):
        ledger.book(device, "CUDA contexts", int(cfg.plan.context_gb * GIB))
    memory = engine_memory(_simulator_arch(cfg), rollout, cfg.user_sim.engines.dtype or cfg.model.dtype, cfg.plan)
    restarted = simulator_restart_rollout(cfg)  # a restarted one starts beside the policy's engine
    pool = LedgerPool(ledger, memory, rollout, devices, SIMULATOR_TAGS, "user simulator engine", restarted)
    asyncio.run(pool.start())
    first = ledger.held[devices[0][0]]
    held = {label: first.get(label, 0) for label in SIMULATOR_TAGS.values()}
    return pool, pool.kv_tokens, held | {"CUDA contexts": int(cfg.plan.context_gb * GIB)}


def _simulator_arch(cfg: RootConfig) -> Architecture:
    model = cfg.user_sim.engines.model
    config = model_shape(model)
    if config is None:
        raise UserError(f"user_sim.engines.model = {model}: no config.json there and not a model whose shape is known")
    return Architecture.from_hf_config(config)


def _simulator_plan(cfg: RootConfig) -> tuple[list[PhaseRow], list[int], list[str]]:
    """The user simulator's engines (`user_sim.engines`) on GPUs of their own: frozen, so what they hold once
    started is what they hold all run (weights, KV pool, runtime); their KV caches in tokens; their problems."""
    from userrl_megatron.fleet.simulator import simulator_rollout

    if not cfg.user_sim.engines.model:
        return [], [], []
    arch = _simulator_arch(cfg)
    rollout = simulator_rollout(cfg)
    tp = rollout.engine_tp
    devices = [list(range(e * tp, (e + 1) * tp)) for e in range(rollout.num_engines)]
    ledger = Ledger.of(rollout.num_engines * tp, int(cfg.plan.device_memory_gb * GIB))
    for device in range(len(ledger.held)):
        ledger.book(device, "CUDA contexts", int(cfg.plan.context_gb * GIB))
    dtype = cfg.user_sim.engines.dtype or cfg.model.dtype
    pool = LedgerPool(ledger, engine_memory(arch, rollout, dtype, cfg.plan), rollout, devices)
    asyncio.run(pool.start())
    per_device = ledger.peaks["start-up"]
    device = max(range(len(per_device)), key=lambda d: per_device[d][0])
    row = PhaseRow("serving", "user sim", device, *per_device[device])
    return [row], pool.kv_tokens, [f"user simulator: {problem}" for problem in ledger.problems]


def _engine_weight_backup(cfg: RootConfig) -> bool:
    """Whether SGLang copies its weights to host memory when it releases them (colocated; on when the weights are
    not synced, `config/resolve.py`)."""
    r = cfg.rollout
    return r.backend == "sglang" and r.colocate and r.sglang.enable_weights_cpu_backup


def _host_rows(
    cfg: RootConfig,
    per_rank: dict[str, int],
    actor_devices: list[int],
    engine_devices: list[list[int]],
    backup: dict[str, dict[int, int]],
) -> list[HostRow]:
    """Each node's pinned host memory: its actor ranks' (every rank alike) and what its engine GPUs back up while
    released (`backup`: by label, bytes per GPU). GPU d sits on node d // `megatron.devices_per_node` (the
    placement's bundles, node by node)."""
    per_node = max(cfg.megatron.devices_per_node, 1)
    ranks: dict[int, int] = {}
    gpus: dict[int, int] = {}
    for device in actor_devices:
        ranks[device // per_node] = ranks.get(device // per_node, 0) + 1
    for device in (d for ds in engine_devices for d in ds):
        gpus[device // per_node] = gpus.get(device // per_node, 0) + 1
    rows = []
    for node in sorted(set(ranks) | set(gpus)):
        held = {label: nbytes * ranks.get(node, 0) for label, nbytes in per_rank.items() if ranks.get(node, 0)}
        for label, per_gpu in backup.items():
            if on_node := sum(nbytes for device, nbytes in per_gpu.items() if device // per_node == node):
                held[label] = on_node
        rows.append(HostRow(node, sum(held.values()), held, ranks.get(node, 0), gpus.get(node, 0)))
    return rows


def _short_run(cfg: RootConfig, out: str) -> RootConfig:
    """The run cut to two steps, each with a checkpoint and (when the run evaluates) an evaluation; quiet."""
    return replace(
        cfg,
        run=replace(cfg.run, total_steps=STEPS, output_dir=out, name="plan"),
        checkpoint=replace(cfg.checkpoint, every_steps=1, resume="disable"),
        eval=replace(cfg.eval, every_steps=1 if cfg.eval.every_steps else 0),
        logging=replace(cfg.logging, backends=[], rollout_dump_every=0),
    )


async def _play(
    cfg: RootConfig, actors: LedgerActors, pool: LedgerPool, runner: LedgerRunner, sim_pool: LedgerPool | None = None
) -> None:
    from userrl_megatron.trainer.components import Components, bring_up
    from userrl_megatron.trainer.driver import Trainer
    from userrl_megatron.trainer.task_stream import TaskStream

    tasks = [Task("plan", f"t{i}", []) for i in range(cfg.rollout.prompts_per_step)]
    parts = Components(cfg, actors, pool, runner, TaskStream(tasks, cfg.run.seed), tasks[:1], sim_pool=sim_pool)
    pool.add_restart_hook(parts.weights.repair)
    quiet = logging.getLogger("userrl_megatron")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the driver's progress lines would describe a run that does not happen
    try:
        await bring_up(parts)
        await Trainer(cfg, Path(cfg.run.output_dir) / cfg.run.name, parts).fit()
    finally:
        quiet.setLevel(level)


def format_plan(plan: MemoryPlan, cfg: RootConfig) -> str:
    """The per-phase table `userrl plan` prints."""
    m, r = cfg.megatron, cfg.rollout
    world = m.nnodes * m.devices_per_node
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    lines = [
        f"{plan.devices} GPUs of {plan.device_bytes / GIB:.1f} GiB (plan.device_memory_gb); actor TP{tp} PP{pp} "
        f"CP{cp} DP{world // (tp * pp * cp)}, recompute {m.recompute}, offload {'on' if m.offload else 'off'}; "
        f"{r.num_engines} {r.backend} engines TP{r.engine_tp}, {'colocated' if r.colocate else 'on their own GPUs'}",
        f"{'phase':<12} {'GPUs':<7} {'GPU':>4} {'GiB':>6} {'free':>6}  held (GiB)",
    ]
    for row in plan.rows:
        held = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(row.held.items(), key=lambda kv: -kv[1]) if v)
        free = (plan.device_bytes - row.used) / GIB
        lines.append(f"{row.phase:<12} {row.kind:<7} {row.device:>4} {row.used / GIB:>6.1f} {free:>6.1f}  {held}")
    peak = plan.peak
    lines.append(f"peak: {peak.used / GIB:.1f} GiB on GPU {peak.device} during {peak.phase}")
    lines.append(
        f"host memory per node, pinned, as torch allocates it (of {plan.host_bytes / GIB:g} GiB, plan.host_memory_gb):"
    )
    for h in plan.host:
        held = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(h.held.items(), key=lambda kv: -kv[1]) if v)
        who = f"actor ranks {h.actor_ranks}, engine GPUs {h.engine_gpus}"
        lines.append(f"node {h.node}: {h.used / GIB:.1f} GiB ({who})" + (f": {held}" if held else ""))
    if plan.kv_tokens:
        kv = min(plan.kv_tokens)
        lines.append(
            f"engine KV cache: {kv:,} tokens per engine; its episodes in flight reach {plan.kv_demand:,} at full "
            f"length" + ("; requests beyond the cache wait" if kv < plan.kv_demand else "")
        )
    lines += [_restart_line(name, restart) for name, restart in plan.restarts.items()]
    if plan.simulator_shared:
        s = cfg.user_sim.engines
        held = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(plan.simulator_shared.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"user simulator: {s.num_engines} engine(s) TP{s.engine_tp} of {s.model} on the policy engines' GPUs (no "
            f"more GPUs): {sum(plan.simulator_shared.values()) / GIB:.1f} GiB per GPU while serving ({held}); KV cache "
            f"{min(plan.simulator_kv_tokens):,} tokens per engine"
        )
    for row in plan.simulator:
        s = cfg.user_sim.engines
        held = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(row.held.items(), key=lambda kv: -kv[1]) if v)
        lines.append(
            f"user simulator: {s.num_engines} engine(s) TP{s.engine_tp} of {s.model} on GPUs of their own "
            f"({s.num_engines * s.engine_tp} more): {row.used / GIB:.1f} GiB per GPU ({held}); KV cache "
            f"{min(plan.simulator_kv_tokens):,} tokens per engine"
        )
    lines.append(_run_size(cfg))
    return "\n".join(lines)


def _restart_line(name: str, restart: Restart) -> str:
    """Where the trainer restarts a dead engine, what the restarted engine gets."""
    where = f"{'an' if name.startswith('engine') else 'a'} {name} restarted after {restart.after}"
    free = f"{restart.free / GIB:.1f} GiB free before its weights"
    if not restart.kv_tokens:
        return f"{where} gets no KV cache ({free}): SGLang refuses to start it, and the pool gives it up"
    return f"{where} gets {restart.kv_tokens:,} KV tokens ({free}), and keeps that pool"


def _run_size(cfg: RootConfig) -> str:
    """The nodes and GPUs the whole run takes: the policy's and the user simulator's (`fleet.placement.run_shape`)."""
    from userrl_megatron.fleet.placement import run_shape

    shape = run_shape(cfg.megatron, cfg.rollout, cfg.user_sim.engines)
    nodes = (
        f"{shape.nodes} node{'s' if shape.nodes > 1 else ''} of {shape.per_node} GPU{'s' if shape.per_node > 1 else ''}"
    )
    line = f"the run takes {nodes} (megatron.devices_per_node): {shape.gpus} GPUs"
    if shape.simulator_gpus:
        line += (
            f", {shape.policy_gpus} for the actor and the policy's engines and {shape.simulator_gpus} for the user "
            "simulator's engines"
        )
    return line


def plan_warnings(plan: MemoryPlan) -> list[str]:
    """What fails only after a fault: an engine the trainer would restart where it cannot start."""
    return [_restart_line(name, r) for name, r in plan.restarts.items() if not r.kv_tokens]


def plan_problems(plan: MemoryPlan) -> list[str]:
    """One line per phase that does not fit, naming the shortfall, then the ledger's ordering problems."""
    out = []
    for row in plan.rows + plan.simulator:
        if row.used > plan.device_bytes:
            out.append(
                f"{row.phase}: GPU {row.device} needs {row.used / GIB:.1f} GiB, "
                f"{(row.used - plan.device_bytes) / GIB:.1f} GiB more than plan.device_memory_gb = "
                f"{plan.device_bytes / GIB:g}"
            )
    for h in plan.host:
        if h.used > plan.host_bytes:
            out.append(
                f"host memory: node {h.node} needs {h.used / GIB:.1f} GiB of pinned memory, "
                f"{(h.used - plan.host_bytes) / GIB:.1f} GiB more than plan.host_memory_gb = {plan.host_bytes / GIB:g}"
            )
    return out + plan.problems
