"""The typed seams between the trainer and the parts it drives: the actor ranks, the engine pool, the episode
runner and the task stream.

`trainer.workers.ActorGroup`, `fleet.pool.RolloutPool`, `rollout.episode.EpisodeRunner` and
`trainer.task_stream.TaskStream` meet them in a run; the planner's ledger stand-ins (`plan/ledger.py`) meet them
in `userrl plan`, so the same choreography (`trainer.components`, `trainer.driver`) runs on either. The type
checker holds both sides to these signatures.
"""

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from userrl_megatron.config.schema import CheckpointConfig
from userrl_megatron.rollout.admission import GroupGate
from userrl_megatron.types import EpisodeGroup, SamplingParams, Task, TrainBatch


class Actors(Protocol):
    """Every Megatron rank at once: each method is a collective that runs on all ranks and returns rank 0's
    answer."""

    def compute_logprobs(self, batch: TrainBatch, trained_only: bool = False) -> list[list[float]]:
        """Log-probs of every token (`trained_only`: of the trained tokens) under the current weights."""
        ...

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Log-probs of the trained tokens under the initial weights (the KL reference)."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over `batch`; its metrics."""
        ...

    def save(self, path: str, extra_state: dict[str, Any], ckpt: CheckpointConfig, background: bool) -> None:
        """Write a checkpoint (`background`: from host copies, committed by `finish_save`)."""
        ...

    def finish_save(self, wait: bool) -> bool:
        """Whether the background save is written (`wait`: block until it is)."""
        ...

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        """Restore a checkpoint; the extra state it was saved with."""
        ...

    def load_weights(self, path: str) -> None:
        """Take the weights of a checkpoint, nothing else (a fresh optimizer)."""
        ...

    def offload(self, weights: bool = True) -> None:
        """Move grads and optimizer state (and `weights`) to host memory."""
        ...

    def onload(self, weights_only: bool = False) -> None:
        """Bring offloaded state back to the devices."""
        ...

    def offloaded(self) -> list[str]:
        """The kinds of state in host memory now ("weights", "grads", "optimizer")."""
        ...

    def export_hf(self, out_dir: str) -> str | None:
        """Write the weights as a Hugging Face directory."""
        ...

    def connect_engines(self, engines: list[dict[str, Any]], group_prefix: str, method: str) -> list[str]:
        """One weight-sync group per pipeline stage with `engines`; the groups' names."""
        ...

    def push_weights(self, group_names: list[str], version: int) -> dict[str, float]:
        """Stream the weights to the engines of `group_names`; the transfer's metrics."""
        ...

    def disconnect_engines(self, group_names: list[str]) -> None: ...

    def weight_checksums(self, rows: int) -> dict[str, float]:
        """Sum of the first `rows` rows of every exported tensor, by HF name."""
        ...


class EngineClient(Protocol):
    """What the trainer asks of one engine directly (memory hand-offs, sync-group teardown, read-back)."""

    @property
    def base_url(self) -> str: ...

    async def release_memory(self, tags: list[str]) -> Any: ...

    async def resume_memory(self, tags: list[str]) -> Any: ...

    async def get_weights_by_name(self, name: str, truncate_size: int = ...) -> Any: ...

    async def destroy_weights_update_group(self, name: str) -> Any: ...


class EnginePool(Protocol):
    """The rollout engines as one fleet: start, pause and resume, repair and restart, cache flushes."""

    @property
    def clients(self) -> Sequence[EngineClient]: ...

    @property
    def urls(self) -> list[str]: ...

    @property
    def api_key(self) -> str: ...

    @property
    def model_path(self) -> str:
        """The checkpoint directory every engine loads at start."""
        ...

    @property
    def concurrency(self) -> int: ...

    @property
    def exhausted(self) -> bool: ...

    @property
    def restarts_total(self) -> int: ...

    @property
    def log_dir(self) -> Path | None: ...

    def add_restart_hook(self, hook: Callable[[int, Any], Awaitable[None]]) -> None: ...

    def session(self, episode_id: str = "") -> Any: ...

    async def start(self) -> None: ...

    async def pause(self, mode: str = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def repair(self, timeout_s: float) -> None: ...

    async def restart(self, urls: list[str], timeout_s: float) -> Any: ...

    async def kill_engine_server(self, index: int) -> int:
        """SIGKILL engine `index`'s server process (fault drills); its pid, -1 when none ran."""
        ...


class Runner(Protocol):
    """Runs groups of episodes against the engines."""

    def sampling(self, temperature: float | None = None) -> SamplingParams | None: ...

    async def run_groups(
        self,
        tasks: list[Task],
        n: int,
        engine_for: Any,
        sampling: SamplingParams | None = None,
        concurrency: int | None = None,
        /,
        *,
        gate: GroupGate | None = None,
    ) -> list[EpisodeGroup]: ...


class Tasks(Protocol):
    """The training tasks, drawn batch by batch in a resumable order."""

    def next(self, count: int) -> list[Task]: ...

    def state(self, carried: Sequence[Task] = ()) -> dict[str, Any]:
        """The position, with `carried` (tasks handed out, not trained on yet) to hand out first after `restore`."""
        ...

    def restore(self, state: dict[str, Any]) -> None: ...
