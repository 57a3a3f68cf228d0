"""`LocalEngine`: the embedded engine as an in-process `RolloutEngine` (no HTTP), for tests and single-process runs."""

from typing import Any

import numpy as np

from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.server.core import EngineCore
from userrl_megatron.server.sampling import parse_sampling_params
from userrl_megatron.server.scheduler import Request
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError, Generation


class LocalEngine:
    """Drives an `EngineCore` directly; same methods and errors as the HTTP client (`SGLangClient`)."""

    def __init__(self, core: EngineCore):
        self.core = core

    @classmethod
    def launch(
        cls, model_path: str, cfg: EmbeddedServerConfig | None = None, dtype: str = "float32", **kwargs: Any
    ) -> "LocalEngine":
        """Load the model and start the scheduler thread."""
        core = EngineCore(model_path, cfg or EmbeddedServerConfig(), dtype, **kwargs)
        core.start()
        return cls(core)

    def close(self) -> None:
        self.core.shutdown()

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        try:
            spec = parse_sampling_params(sampling.to_dict(), self.core.model.spec.vocab_size)
            self.core.check_input(input_ids, spec.max_new_tokens)
        except ValueError as e:
            raise EngineError(str(e)) from e
        routed = routed_experts_start_len is not None
        if routed and not self.core.scheduler.records_routing:
            raise EngineError("routed experts need an engine started with enable_return_routed_experts")
        request = Request(
            list(input_ids),
            spec,
            return_logprob=True,
            return_routed_experts=routed,
            routed_experts_start_len=routed_experts_start_len or 0,
        )
        return generation_of(await self.core.generate(request))

    async def health(self) -> bool:
        return await self.core.health()

    async def flush_cache(self) -> None:
        ok, message = await self.core.flush_cache()
        if not ok:
            raise EngineError(f"flush_cache refused: {message or 'requests are running or waiting'}")

    async def pause(self, mode: str = "abort") -> None:
        await self.core.pause_generation(mode)

    async def resume(self) -> None:
        await self.core.continue_generation()

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        _check(
            await self.core.init_weights_update_group(
                master_address, master_port, rank_offset, world_size, group_name, backend
            )
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        _check(await self.core.destroy_weights_update_group(group_name))

    async def begin_weight_update(self) -> None:
        _check(await self.core.begin_weight_update())

    async def end_weight_update(self) -> None:
        _check(await self.core.end_weight_update())

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        _check(
            await self.core.update_weights_from_tensor(
                serialized_named_tensors, load_format, flush_cache, weight_version=weight_version
            )
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None:
        _check(
            await self.core.update_weights_from_distributed(
                names, dtypes, shapes, group_name, flush_cache, weight_version=weight_version, load_format=load_format
            )
        )

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.core.release_memory_occupation(tags)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.core.resume_memory_occupation(tags)

    async def get_model_info(self) -> dict[str, Any]:
        return self.core.model_info()


def generation_of(request: Request) -> Generation:
    """The protocol's view of a finished request."""
    assert request.finish_reason is not None
    return Generation(
        output_ids=list(request.output_ids),
        output_logprobs=list(request.output_logprobs),
        finish_reason=request.finish_reason["type"],
        weight_version=request.weight_version,
        prompt_tokens=len(request.input_ids),
        latency_s=request.finished_at - request.created,
        routed_experts=_routed(request),
    )


def _routed(request: Request) -> np.ndarray | None:
    if not request.return_routed_experts or not request.routed:  # not asked, or aborted before any forward
        return None
    rows = max(len(request.input_ids) + len(request.output_ids) - 1 - request.routed_experts_start_len, 0)
    return request.routed[0].reshape(rows, -1).numpy().copy()


def _check(result: tuple[bool, str]) -> None:
    ok, message = result
    if not ok:
        raise EngineError(message)
