"""The typed seams between the trainer and the parts it drives: the engine pool, the episode runner and the task
stream (the actor ranks' seam, `actors.protocol.Actors`, is shared with `userrl sft`).

`fleet.pool.RolloutPool`, `rollout.episode.EpisodeRunner` and `trainer.task_stream.TaskStream` meet them in a run;
the planner's ledger stand-ins (`plan/ledger.py`) meet them in `userrl plan`, so the same choreography
(`trainer.components`, `trainer.driver`) runs on either. The type checker holds both sides to these signatures.
"""

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from userrl_megatron.rollout.admission import GroupGate
from userrl_megatron.types import EpisodeGroup, SamplingParams, Task


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
