"""Ray actors for the Megatron ranks: each runs torch.distributed inside and exposes the actor interface.

`MegatronWorker` holds one rank's `MegatronActor`; `ActorGroup` (driver side) starts one worker per rank on its
placement bundle, wires rank 0's address as the master, and fans every call out to all ranks (the actor's
methods are collective), returning rank 0's answer. Results cross the Ray boundary as plain Python data.
"""

import logging
import socket
from dataclasses import dataclass
from typing import Any

from userrl_megatron.config.schema import AlgoConfig, CheckpointConfig, MegatronConfig, ModelConfig, SyncConfig
from userrl_megatron.types import TrainBatch

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its actor (each component gets its own config section)."""

    model: ModelConfig
    megatron: MegatronConfig
    algo: AlgoConfig
    sync: SyncConfig
    seed: int


class MegatronWorker:
    """One Megatron rank (a Ray actor). Construct, then `setup()` on every rank with rank 0's address."""

    def __init__(self, rank: int, world_size: int, spec: WorkerSpec) -> None:
        import torch

        from userrl_megatron.observability.noise import quiet_third_party

        quiet_third_party(on_gpu=torch.cuda.is_available())  # before megatron.core is imported in this process
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.actor: Any = None
        self.senders: dict[str, Any] = {}  # weight-sync group name -> WeightSender (stage source ranks only)
        self.reference: Any = None  # megatron.reference.ReferenceWeights: initial weights, for the KL term

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0's become the master address)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, int]:
        """Join torch.distributed, build the model and optimizer, load the HF weights; returns the layout."""
        from userrl_megatron.megatron import parallel
        from userrl_megatron.megatron.actor import MegatronActor

        spec = self.spec
        layout = parallel.initialize(
            spec.megatron, rank=self.rank, world_size=self.world_size, master_addr=master_addr, master_port=master_port
        )
        self.actor = MegatronActor(spec.model, spec.megatron, spec.algo, spec.seed)
        if spec.algo.kl_coef > 0:
            from userrl_megatron.megatron.reference import ReferenceWeights

            self.reference = ReferenceWeights(self._parameters())
        return {"tp_rank": layout.tp_rank, "pp_rank": layout.pp_rank, "dp_rank": layout.dp_rank, "pp": layout.pp}

    # ---- the actor interface ----

    def compute_logprobs(self, batch: TrainBatch, trained_only: bool = False) -> list[list[float]] | None:
        out = self.actor.compute_logprobs(batch, trained_only=trained_only)
        return out if self.rank == 0 else None

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]] | None:
        """Log-probs under the initial weights: swap them in, score, swap the trained weights back."""
        if self.reference is None:
            raise RuntimeError("reference log-probs need algo.kl_coef > 0 at start-up")
        self.actor.parking.require("the reference-weights swap")
        with self.reference.swapped_in(self._parameters()):
            out = self.actor.compute_logprobs(batch, trained_only=True)  # the KL term covers trained tokens only
        return out if self.rank == 0 else None

    def train_step(self, batch: TrainBatch) -> dict[str, float] | None:
        metrics = self.actor.train_step(batch)
        return metrics if self.rank == 0 else None

    def save(self, path: str, extra_state: dict[str, Any], ckpt: CheckpointConfig, background: bool) -> None:
        self.actor.save(
            path, extra_state, ckpt.keep_last, ckpt.save_optimizer, ckpt.optimizer_format, background=background
        )

    def finish_save(self, wait: bool) -> bool:
        return self.actor.finish_save(wait)

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        return self.actor.load(path, with_optimizer)

    def load_weights(self, path: str) -> None:
        self.actor.load_weights(path)

    def offload(self, weights: bool = True) -> None:
        self.actor.offload(weights)

    def onload(self, weights_only: bool = False) -> None:
        self.actor.onload(weights_only)

    def offloaded(self) -> list[str]:
        return self.actor.offloaded()

    def export_hf(self, out_dir: str) -> str | None:
        """Write the model as an HF directory (safetensors, config, tokenizer); each stage writes its shards."""
        self.actor.export_hf_dir(out_dir)
        return out_dir if self.rank == 0 else None

    # ---- weight sync ----

    def connect_engines(self, engines: list[dict[str, Any]], group_name: str, stage: int, method: str) -> bool:
        """Stage `stage`'s source rank becomes the sender `group_name` to every engine; others do nothing.

        `method` "distributed": a process group with the engines (their broadcast); "tensor": handles to memory on
        this rank's device (`sync/tensor_sender.py`). With "tensor", the other ranks of the stage's TP group that
        sit on an engine TP rank's device take part too, each handing that engine rank its own copy."""
        from userrl_megatron.sync.sender import EngineEndpoint, WeightSender
        from userrl_megatron.sync.tensor_sender import Peers, TensorSender, payload_holders

        endpoints = [EngineEndpoint(**e) for e in engines]
        layout = self.actor.layout
        if method == "tensor":
            if layout.pp_rank != stage or layout.dp_rank != 0 or layout.cp_rank != 0:
                return False
            group, ranks = self.actor.tp_group_ranks()
            relayed = any(h != ranks[0] for row in payload_holders(endpoints, ranks) for h in row)
            if not relayed and not self._is_source_of(stage):
                return False
            peers = Peers(group, ranks, layout.rank) if relayed else None
            sender: WeightSender = TensorSender(self.spec.sync, endpoints, group_name, _sync_device(), peers=peers)
            sender.connect()
        else:
            if not self._is_source_of(stage):
                return False
            sender = WeightSender(self.spec.sync, endpoints, group_name, _sync_backend())
            host, port = self.address()
            sender.connect(host, port)
        self.senders[group_name] = sender
        return True

    def push_weights(self, group_name: str, stage: int, version: int) -> dict[str, float] | None:
        """Stream stage `stage`'s weights to the engines of `group_name` (collective in that stage's TP group)."""
        layout = self.actor.layout
        if layout.pp_rank != stage:
            return None
        sender = self.senders.get(group_name)
        # Every rank of the TP group runs the same export: all-gathered when its members hand out their own copies.
        everywhere = getattr(sender, "peers", None) is not None
        weights = self.actor.export_hf_weights(everywhere=everywhere)
        if sender is None:
            for _ in weights:  # take part in the stage's gathers; only the source rank yields tensors
                pass
            return None
        return sender.push(weights, version)

    def disconnect_engines(self, group_name: str) -> None:
        sender = self.senders.pop(group_name, None)
        if sender is not None:
            sender.close()

    def weight_checksums(self, rows: int) -> dict[str, float]:
        """Sum of the first `rows` rows of every exported tensor (what `/get_weights_by_name` returns)."""
        return {name: float(t[:rows].double().sum()) for name, t in self.actor.export_hf_weights()}

    def _is_source_of(self, stage: int) -> bool:
        return self.actor.layout.pp_rank == stage and self.actor.layout.is_stage_source

    def _parameters(self) -> list[Any]:
        return [p for chunk in self.actor.chunks for p in chunk.parameters()]


class ActorGroup:
    """Driver-side handle of every Megatron rank; each call runs on all ranks and returns rank 0's result."""

    def __init__(self, placement: Any, spec: WorkerSpec, env: dict[str, str] | None = None) -> None:
        import ray

        m = spec.megatron
        self.world_size = m.nnodes * m.devices_per_node
        remote = ray.remote(MegatronWorker)
        runtime_env = {"env_vars": env} if env else None
        self.workers = [
            remote.options(**placement.actor_options(r), runtime_env=runtime_env).remote(r, self.world_size, spec)
            for r in range(self.world_size)
        ]
        from userrl_megatron.observability.progress import blocking_heartbeat

        with blocking_heartbeat(lambda: f"actor: {self.world_size} rank(s) still starting (process, model load)"):
            master_addr, master_port = ray.get(self.workers[0].address.remote())
            layouts = self._get([w.setup.remote(master_addr, master_port) for w in self.workers])
        self.pipeline_stages = layouts[0]["pp"]
        log.info("actor group: %d ranks, %d pipeline stages", self.world_size, self.pipeline_stages)

    def call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank; rank 0's result. A long call logs a heartbeat every 30 s."""
        import ray

        from userrl_megatron.observability.progress import blocking_heartbeat

        refs = [ray.put(a) if isinstance(a, TrainBatch) else a for a in args]
        with blocking_heartbeat(lambda: f"actor: {method} still running"):
            return self._get([getattr(w, method).remote(*refs) for w in self.workers])[0]

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
        import ray

        for w in self.workers:
            ray.kill(w)

    def _get(self, refs: list[Any]) -> list[Any]:
        import ray

        return ray.get(refs)


def _sync_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _sync_device() -> str:
    """Where a rank's tensor-handle buckets live: its current GPU, or shared host memory."""
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
