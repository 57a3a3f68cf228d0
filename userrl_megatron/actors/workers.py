"""Ray actors for the Megatron ranks: each runs torch.distributed inside and exposes the actor interface.

`MegatronWorker` holds one rank's `MegatronActor`; `ActorGroup` (driver side) starts one worker per rank on its
placement bundle, wires rank 0's address as the master, and fans every call out to all ranks (the actor's
methods are collective), returning rank 0's answer. Results cross the Ray boundary as plain Python data.

A worker sees exactly the GPU of its bundle (`CUDA_VISIBLE_DEVICES` as Ray assigns it, set again from
`ray.get_gpu_ids()` should Ray leave it alone) and computes on its device 0. With `WorkerSpec.dry` a worker goes
the same way up to `torch.distributed` and CUDA, and records what it would do there instead (`RankLaunch`,
`SyncRole`): the simulated bring-up of `trainer/dry_run.py`.
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from userrl_megatron.config.schema import AlgoConfig, CheckpointConfig, MegatronConfig, ModelConfig, SyncConfig
from userrl_megatron.ports import free_port
from userrl_megatron.types import TrainBatch

if TYPE_CHECKING:
    from userrl_megatron.megatron.actor import MegatronActor

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
CLOSE_TIMEOUT_S = 60.0  # how long a shutdown waits for the ranks to close their weight senders


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its actor (each component gets its own config section)."""

    model: ModelConfig
    megatron: MegatronConfig
    algo: AlgoConfig
    sync: SyncConfig
    seed: int
    dry: bool = False  # record what each rank would run instead of starting torch.distributed and CUDA


@dataclass(frozen=True)
class RankLaunch:
    """What one actor rank runs and where: the record of a dry start."""

    rank: int
    world_size: int
    local_rank: int  # its index among the actor ranks on its node
    ip: str  # its node
    visible_devices: str  # CUDA_VISIBLE_DEVICES in its process ("" for none)
    device: str  # "cuda:N" (N among the visible devices) or "cpu"
    backend: str  # torch.distributed backend: "nccl" or "gloo"
    master_addr: str
    master_port: int
    parallel: dict[str, int]  # tp_rank, cp_rank, dp_rank, pp_rank, ep_rank and the sizes tp, cp, dp, pp, ep


@dataclass(frozen=True)
class SyncRole:
    """A rank's part in one weight-sync group: the record of a dry `connect_engines` (None: no part)."""

    group: str
    method: str  # "distributed" (a process group with the engines) or "tensor" (handles)
    rank: int  # this actor rank
    stage: int
    world_size: int = 0  # distributed: the group's size, this rank (0) + every engine TP rank
    engine_ranks: list[int] = field(default_factory=list)  # distributed: each engine's first rank in the group
    members: list[int] = field(default_factory=list)  # tensor: the ranks packing their own copy (source first)
    holders: list[list[int]] = field(default_factory=list)  # tensor: per engine TP rank, the rank whose copy it maps


class MegatronWorker:
    """One Megatron rank (a Ray actor). Construct, then `setup()` on every rank with rank 0's address."""

    def __init__(self, rank: int, world_size: int, spec: WorkerSpec, local_rank: int = 0) -> None:
        import ray

        gpus = ray.get_gpu_ids()
        if gpus:  # its own GPU only (Ray sets this unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is on)
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        self.rank, self.world_size, self.spec, self.local_rank = rank, world_size, spec, local_rank
        self.actor: Any = None
        self.senders: dict[str, Any] = {}  # weight-sync group name -> WeightSender (stage source ranks only)
        self.reference: Any = None  # megatron.reference.ReferenceWeights: initial weights, for the KL term
        self.launch: RankLaunch | None = None  # dry: what setup would have run
        self.roles: list[SyncRole] = []  # dry: the weight-sync groups it would have joined
        if spec.dry:
            return
        import torch

        from userrl_megatron.observability.noise import quiet_third_party

        quiet_third_party(on_gpu=torch.cuda.is_available())  # before megatron.core is imported in this process

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0's become the master address)."""
        import ray

        return ray.util.get_node_ip_address(), free_port("")

    def setup(self, master_addr: str, master_port: int) -> dict[str, int]:
        """Join torch.distributed, build the model and optimizer, load the HF weights; returns the layout.
        Dry: record the rank's launch (`launch_record`) and return the layout it would get."""
        spec = self.spec
        if spec.dry:
            self.launch = self._dry_launch(master_addr, master_port)
            return {k: self.launch.parallel[k] for k in ("tp_rank", "pp_rank", "dp_rank", "pp")}
        from userrl_megatron.megatron import cpu, parallel

        cpu.stub_missing_kernels()  # megatron.core, imported next, needs it without triton
        from userrl_megatron.megatron.actor import MegatronActor

        layout = parallel.initialize(
            spec.megatron,
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            device_peers=(0, 1),  # a Ray actor sees its own GPU only
        )
        self.actor = MegatronActor(spec.model, spec.megatron, spec.algo, spec.seed)
        if spec.algo.kl_coef > 0:
            from userrl_megatron.megatron.reference import ReferenceWeights

            self.reference = ReferenceWeights(self._parameters())
        return {"tp_rank": layout.tp_rank, "pp_rank": layout.pp_rank, "dp_rank": layout.dp_rank, "pp": layout.pp}

    def _dry_launch(self, master_addr: str, master_port: int) -> RankLaunch:
        """What `setup` would start: the checks and the device choice of `megatron.parallel.initialize`, the
        parallel ranks Megatron would give this rank."""
        import ray

        from userrl_megatron.config.layout import layout_problems, rank_coordinates, rank_device
        from userrl_megatron.config.loader import ConfigError

        m = self.spec.megatron
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        problems = layout_problems(m, self.world_size, on_gpu=bool(visible))
        if problems:
            raise ConfigError(problems)
        device = rank_device(len([d for d in visible.split(",") if d]), 0, 1)  # as `initialize` under Ray
        return RankLaunch(
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            ip=ray.util.get_node_ip_address(),
            visible_devices=visible,
            device="cpu" if device is None else f"cuda:{device}",
            backend="gloo" if device is None else "nccl",
            master_addr=master_addr,
            master_port=master_port,
            parallel=rank_coordinates(m, self.rank, self.world_size),
        )

    def launch_record(self) -> RankLaunch | None:
        """Dry: what this rank's `setup` would have run."""
        return self.launch

    # ---- the actor interface ----

    def run(self, method: "Callable[Concatenate[MegatronActor, P], R]", *args: P.args, **kwargs: P.kwargs) -> R | None:
        """Call one method of this rank's `MegatronActor` (the group passes the method itself, so the call is
        type-checked against its signature); rank 0's answer, None elsewhere (the others are not shipped)."""
        out = method(self.actor, *args, **kwargs)
        return out if self.rank == 0 else None

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]] | None:
        """Log-probs under the initial weights: swap them in, score, swap the trained weights back."""
        if self.reference is None:
            raise RuntimeError("reference log-probs need algo.kl_coef > 0 at start-up")
        self.actor.parking.require("the reference-weights swap")
        with self.reference.swapped_in(self._parameters()):
            out = self.actor.compute_logprobs(batch, trained_only=True)  # the KL term covers trained tokens only
        return out if self.rank == 0 else None

    def connect_engines(self, engines: list[dict[str, Any]], group_name: str, stage: int, method: str) -> bool:
        """Stage `stage`'s source rank becomes the sender `group_name` to every engine; others do nothing.

        `method` "distributed": a process group with the engines (their broadcast); "tensor": handles to memory on
        this rank's device (`sync/tensor_sender.py`). With "tensor", when an engine TP rank sits on the device of
        another rank of the stage (any tensor-, data- or context-parallel rank: they hold the same weights), every
        rank of the stage takes part, each handing the engine ranks on its device its own copy: a handle never
        crosses nodes, and none needs peer access to another GPU. Dry: the role is recorded (`sync_roles`),
        nothing is connected."""
        from userrl_megatron.sync.roles import EngineEndpoint

        endpoints = [EngineEndpoint(**e) for e in engines]
        if self.spec.dry:
            from userrl_megatron.config.layout import stage_ranks

            assert self.launch is not None, "setup() first"
            ranks = stage_ranks(self.spec.megatron, self.rank, self.world_size)
            role = self._sync_role(endpoints, group_name, stage, method, self.launch.parallel, ranks)
            if role is not None:
                self.roles.append(role)
            return role is not None
        from userrl_megatron.megatron import parallel
        from userrl_megatron.sync.sender import WeightSender
        from userrl_megatron.sync.tensor_sender import Peers, TensorSender

        layout = self.actor.layout
        group, ranks = parallel.stage_group()
        coords = {"tp_rank": layout.tp_rank, "cp_rank": layout.cp_rank, "dp_rank": layout.dp_rank}
        role = self._sync_role(endpoints, group_name, stage, method, coords | {"pp_rank": layout.pp_rank}, ranks)
        if role is None:
            return False
        if role.method == "tensor":
            peers = Peers(group, ranks, layout.rank) if len(role.members) > 1 else None
            handles = TensorSender(self.spec.sync, endpoints, group_name, _sync_device(), peers=peers)
            handles.connect()
            sender: WeightSender = handles
        else:
            sender = WeightSender(self.spec.sync, endpoints, group_name, _sync_backend())
            host, port = self.address()
            sender.connect(host, port)
        self.senders[group_name] = sender
        return True

    def _sync_role(
        self,
        endpoints: list[Any],
        group_name: str,
        stage: int,
        method: str,
        coords: dict[str, int],
        stage_ranks: list[int],
    ) -> SyncRole | None:
        """This rank's part in weight-sync group `group_name` of stage `stage` (None: none), from its parallel
        ranks `coords` and the global ranks of its pipeline stage (source first)."""
        from userrl_megatron.sync.roles import engine_offsets, group_world_size, payload_holders

        if coords["pp_rank"] != stage:
            return None
        source = coords["tp_rank"] == 0 and coords["dp_rank"] == 0 and coords["cp_rank"] == 0
        if method == "tensor":
            holders = payload_holders(endpoints, stage_ranks)
            relayed = any(h != stage_ranks[0] for row in holders for h in row)
            if not relayed and not source:
                return None
            members = list(stage_ranks) if relayed else [self.rank]
            return SyncRole(group_name, "tensor", self.rank, stage, members=members, holders=holders)
        if not source:
            return None
        world = group_world_size(endpoints)
        return SyncRole(group_name, "distributed", self.rank, stage, world, engine_offsets(endpoints))

    def sync_roles(self) -> list[SyncRole]:
        """Dry: this rank's part in every weight-sync group connected so far."""
        return list(self.roles)

    def push_weights(self, group_name: str, stage: int, version: int) -> dict[str, float] | None:
        """Stream stage `stage`'s weights to the engines of `group_name` (collective in that stage's TP group)."""
        layout = self.actor.layout
        if layout.pp_rank != stage:
            return None
        sender = self.senders.get(group_name)
        # Every rank of the stage runs the same export: all-gathered when its ranks hand out their own copies.
        everywhere = getattr(sender, "peers", None) is not None
        weights = self.actor.export_hf_plans(everywhere=everywhere)
        if sender is None:
            for _ in weights:  # take part in the stage's gathers; only the source rank yields tensors
                pass
            return None
        return sender.push(weights, version)

    def disconnect_engines(self, group_name: str) -> None:
        sender = self.senders.pop(group_name, None)
        if sender is not None:
            sender.close()

    def close_senders(self) -> None:
        """Close every weight sender: groups left, shared segments' files removed (after `ray.kill` nothing would:
        Ray kills the actor's children too, torch's shared-memory manager included)."""
        for name in list(self.senders):
            self.disconnect_engines(name)

    def weight_checksums(self, rows: int) -> dict[str, float]:
        """Sum of the first `rows` rows of every exported tensor (what `/get_weights_by_name` returns)."""
        return {name: float(t[:rows].double().sum()) for name, t in self.actor.export_hf_weights()}

    def _parameters(self) -> list[Any]:
        return [p for chunk in self.actor.chunks for p in chunk.parameters()]


class ActorGroup:
    """Driver-side handle of every Megatron rank; each call runs on all ranks and returns rank 0's result."""

    def __init__(self, placement: Any, spec: WorkerSpec, env: dict[str, str] | None = None) -> None:
        import ray

        from userrl_megatron.megatron.cpu import stub_missing_kernels

        stub_missing_kernels()  # a tensor pickled by a rank names megatron.core: this process must import it
        m = spec.megatron
        self.world_size = m.nnodes * m.devices_per_node
        remote = ray.remote(MegatronWorker)
        runtime_env = {"env_vars": env} if env else None
        self.workers: list[Any] = [  # Ray actor handles (their methods are called with `.remote`)
            remote.options(**placement.actor_options(r), runtime_env=runtime_env).remote(
                r, self.world_size, spec, placement.local_rank(r)
            )
            for r in range(self.world_size)
        ]
        from userrl_megatron.observability.progress import blocking_heartbeat

        with blocking_heartbeat(lambda: f"actor: {self.world_size} rank(s) still starting (process, model load)"):
            master_addr, master_port = ray.get(self.workers[0].address.remote())
            layouts = self._get([w.setup.remote(master_addr, master_port) for w in self.workers])
        self.pipeline_stages = layouts[0]["pp"]
        log.info("actor group: %d ranks, %d pipeline stages", self.world_size, self.pipeline_stages)

    def launches(self) -> list[RankLaunch]:
        """Dry: what every rank's setup would have run, in rank order."""
        return self._get([w.launch_record.remote() for w in self.workers])

    def sync_roles(self) -> list[SyncRole]:
        """Dry: every rank's part in the weight-sync groups connected so far, in rank order."""
        return [role for roles in self._get([w.sync_roles.remote() for w in self.workers]) for role in roles]

    # ---- the collectives (`actors.protocol.Actors`): every rank runs the call, rank 0's answer comes back ----

    def compute_logprobs(self, batch: TrainBatch, trained_only: bool = False) -> list[list[float]]:
        return self._each_rank("log-probs", _actor().compute_logprobs, _put(batch), trained_only=trained_only)

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        ref = _put(batch)
        return self._all("reference log-probs", lambda w: w.compute_ref_logprobs.remote(ref))

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._each_rank("train step", _actor().train_step, _put(batch))

    def save(self, path: str, extra_state: dict[str, Any], ckpt: CheckpointConfig, background: bool) -> None:
        self._each_rank(
            "checkpoint save",
            _actor().save,
            path,
            extra_state,
            ckpt.keep_last,
            ckpt.save_optimizer,
            ckpt.optimizer_format,
            background=background,
        )

    def finish_save(self, wait: bool) -> bool:
        return self._each_rank("checkpoint commit", _actor().finish_save, wait)

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        return self._each_rank("checkpoint load", _actor().load, path, with_optimizer)

    def load_weights(self, path: str) -> None:
        self._each_rank("weights load", _actor().load_weights, path)

    def offload(self, weights: bool = True) -> None:
        self._each_rank("offload", _actor().offload, weights)

    def onload(self, weights_only: bool = False) -> None:
        self._each_rank("onload", _actor().onload, weights_only)

    def offloaded(self) -> list[str]:
        return self._each_rank("offload query", _actor().offloaded)

    def export_hf(self, out_dir: str) -> str | None:
        """Write the model as an HF directory (safetensors, config, tokenizer); each stage writes its shards."""
        self._each_rank("HF export", _actor().export_hf_dir, out_dir)
        return out_dir

    def _each_rank(
        self, what: str, method: "Callable[Concatenate[MegatronActor, P], R]", *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Run one `MegatronActor` method on every rank (`MegatronWorker.run`); rank 0's result."""
        return self._all(what, lambda w: w.run.remote(method, *args, **kwargs))

    def _all(self, what: str, remote_call: Callable[[Any], Any]) -> Any:
        """Run one call on every rank; rank 0's result. A long call logs a heartbeat every 30 s."""
        from userrl_megatron.observability.progress import blocking_heartbeat

        with blocking_heartbeat(lambda: f"actor: {what} still running"):
            return self._get([remote_call(w) for w in self.workers])[0]

    def connect_engines(self, engines: list[dict[str, Any]], group_prefix: str, method: str) -> list[str]:
        """One weight sender per pipeline stage, created stage after stage (engines join their groups in order)."""
        names = []
        for stage in range(self.pipeline_stages):
            name = f"{group_prefix}_pp{stage}"
            self._get([w.connect_engines.remote(engines, name, stage, method) for w in self.workers])
            names.append(name)
        return names

    def push_weights(self, group_names: list[str], version: int) -> dict[str, float]:
        """Push every stage's weights, one stage at a time (an engine takes part in one broadcast at a time)."""
        from userrl_megatron.observability.progress import blocking_heartbeat

        total: dict[str, float] = {}
        for stage, name in enumerate(group_names):
            with blocking_heartbeat(lambda: f"weight sync: pipeline stage {stage} still streaming"):  # noqa: B023
                results = self._get([w.push_weights.remote(name, stage, version) for w in self.workers])
            for metrics in results:
                for key, value in (metrics or {}).items():
                    total[key] = total.get(key, 0.0) + value
        if total.get("sync/seconds"):
            total["sync/gb_per_s"] = total["sync/bytes"] / total["sync/seconds"] / 1e9
        return total

    def disconnect_engines(self, group_names: list[str]) -> None:
        for name in group_names:
            self._get([w.disconnect_engines.remote(name) for w in self.workers])

    def weight_checksums(self, rows: int) -> dict[str, float]:
        """Checksums of every HF tensor, merged over the pipeline stages."""
        merged: dict[str, float] = {}
        for part in self._get([w.weight_checksums.remote(rows) for w in self.workers]):
            merged.update(part)
        return merged

    def shutdown(self) -> None:
        """Let every rank close its weight senders (a dead rank has none left), then kill the ranks."""
        import ray

        refs = [w.close_senders.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)  # errors count as done: nothing to raise
        for w in self.workers:
            ray.kill(w)

    def _get(self, refs: list[Any]) -> list[Any]:
        import ray

        return ray.get(refs)


def thread_env(placement: Any) -> dict[str, str]:
    """The environment of the actor ranks of `placement`: this machine's cores shared among them
    (`OMP_NUM_THREADS`)."""
    from userrl_megatron.cores import core_count

    return {"OMP_NUM_THREADS": str(max(1, core_count() // max(1, len(placement.plan.actor_bundles))))}


def _actor() -> "type[MegatronActor]":
    """The class whose methods the group runs on its ranks (imported on first use: it imports megatron.core)."""
    from userrl_megatron.megatron.actor import MegatronActor

    return MegatronActor


def _put(batch: TrainBatch) -> Any:
    """The batch in Ray's object store once, for every rank to read."""
    import ray

    return ray.put(batch)


def _sync_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _sync_device() -> str:
    """Where a rank's tensor-handle buckets live: its current GPU, or shared host memory."""
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
