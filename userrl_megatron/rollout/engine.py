"""The rollout-engine interface: token ids in, token ids and their log-probs out.

The method names and payloads are SGLang's native HTTP API (`/generate`, `/init_weights_update_group`,
`/update_weights_from_distributed`, `/flush_cache`, `/pause_generation`, ...), so one client drives real
SGLang servers and the embedded server alike.
"""

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from userrl_megatron.types import SamplingParams


class EngineError(RuntimeError):
    """An engine refused or failed a call (SGLang `success: false`, a 4xx/5xx, or no answer after retries)."""


@dataclass
class Generation:
    """The result of one generate call."""

    output_ids: list[int]
    output_logprobs: list[float]  # log-prob of each output token under the engine's weights
    finish_reason: str  # "stop" (EOS or a stop token), "length" (max_new_tokens) or "abort"
    weight_version: str = "default"
    prompt_tokens: int = 0
    latency_s: float = 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the episode runner and the weight sync need from an engine."""

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation:
        """Continue `input_ids`; the output never includes the input."""
        ...

    async def health(self) -> bool:
        """True when the engine answers and can generate."""
        ...

    async def flush_cache(self) -> None: ...

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating (SGLang `/pause_generation`): "abort" in-flight requests (they return partial output
        with finish_reason "abort"), "retract" them (recomputed after resume), or freeze them "in_place"."""
        ...

    async def resume(self) -> None:
        """Undo `pause` (SGLang `/continue_generation`)."""
        ...

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None: ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None: ...

    async def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang 0.5.23 requires one around update_weights_from_distributed)."""
        ...

    async def end_weight_update(self) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang `/release_memory_occupation` (tags: "kv_cache", "weights", "cuda_graph"; None = all)."""
        ...

    async def resume_memory(self, tags: list[str] | None = None) -> None: ...

    async def get_model_info(self) -> dict[str, Any]: ...
