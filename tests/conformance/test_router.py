"""sglang-router 0.3.2 (from .venv-sglang) in front of every engine (both backends, each model): generation goes
through it, control endpoints do not (the project sends those to each engine directly)."""

import asyncio
from typing import Any

from tests.conformance.conftest import SGLANG_CPU, Engine
from tests.conformance.test_generate import chat_ids, get, post
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.router import launch_router, list_workers
from userrl_megatron.ports import free_port
from userrl_megatron.types import SamplingParams


def test_generation_through_the_router(engine: Engine, tmp_path: Any) -> None:
    log = tmp_path / "router.log"
    router = launch_router(SGLANG_CPU, [engine.url], free_port(), free_port(), log_path=log, timeout_s=600)
    prompt = chat_ids(engine.model_dir)
    greedy = SamplingParams(max_new_tokens=3, temperature=0)

    async def go() -> tuple[Any, Any, dict[str, int]]:
        async with SGLangClient(router.url) as via_router, SGLangClient(engine.url) as direct:
            routed, reference = await via_router.generate(prompt, greedy), await direct.generate(prompt, greedy)
        statuses = {
            "model_info": (await get(router.url, "/model_info"))[0],
            "pause_generation": (await post(router.url, "/pause_generation", {"mode": "abort"}))[0],
            "release_memory_occupation": (await post(router.url, "/release_memory_occupation", {"tags": None}))[0],
            "update_weights_from_distributed": (
                await post(router.url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
            )[0],
        }
        return routed, reference, statuses

    try:
        assert [w["url"] for w in list_workers(router.url)] == [engine.url]
        routed, reference, statuses = asyncio.run(go())
    finally:
        router.stop()
    assert routed.output_ids == reference.output_ids
    diffs = [abs(a - b) for a, b in zip(routed.output_logprobs, reference.output_logprobs, strict=True)]
    assert max(diffs) < engine.logprob_tol  # the second request may hit the prefix cache
    assert statuses == dict.fromkeys(statuses, 404)  # what the router does not forward
