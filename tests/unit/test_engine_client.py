"""SGLangClient against a real local aiohttp server on 127.0.0.1 that plays a flaky or old SGLang server:
exact payloads, retries with backoff on 5xx and connection errors, no retry on 4xx, old-server fallbacks."""

import asyncio
from typing import Any

import pytest
from aiohttp import web

from userrl_megatron.fleet.engine import RolloutEngine, SGLangClient
from userrl_megatron.server.protocol import contract_error
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError

REPLY = {
    "output_ids": [4, 5],
    "meta_info": {
        "id": "x",
        "finish_reason": {"type": "stop", "matched": 5},
        "prompt_tokens": 3,
        "weight_version": "7",
        "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]],
        "e2e_latency": 0.125,
    },
}


class FakeSGLang:
    """Answers /generate with `failures` 503s first; records every body. No /begin_weight_update (old server)."""

    def __init__(self, failures: int):
        self.failures, self.bodies, self.paths = failures, [], []

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        body = await request.json() if request.can_read_body else None
        self.bodies.append(body)
        if request.path == "/generate":
            if self.failures:
                self.failures -= 1
                return web.Response(status=503)
            if body["input_ids"] == [0]:
                return web.json_response({"error": {"message": "input too long"}}, status=400)
            return web.json_response(REPLY)
        if request.path in ("/update_weights_from_distributed", "/end_weight_update"):
            return web.json_response({"success": False, "message": "Failed to receive weights: boom"}, status=400)
        if request.path == "/get_model_info":
            return web.json_response({"model_path": "/m"})
        return web.json_response({"error": "not found"}, status=404)


async def with_server(fake: FakeSGLang, body: Any) -> Any:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01) as client:
            return await body(client)
    finally:
        await runner.cleanup()


def test_client_is_a_rollout_engine() -> None:
    assert isinstance(SGLangClient("http://127.0.0.1:9"), RolloutEngine)


def test_generate_payload_and_parsing_after_retries() -> None:
    fake = FakeSGLang(failures=2)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.5, stop_token_ids=[5], seed=3)
    gen = asyncio.run(with_server(fake, lambda c: c.generate([1, 2, 3], sampling)))
    assert (gen.output_ids, gen.output_logprobs, gen.finish_reason) == ([4, 5], [-0.5, -0.25], "stop")
    assert (gen.weight_version, gen.prompt_tokens, gen.latency_s) == ("7", 3, 0.125)
    assert fake.paths == ["/generate"] * 3
    expected = {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": 0.5,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [5],
            "sampling_seed": 3,
        },
        "return_logprob": True,
    }
    assert fake.bodies[-1] == expected and contract_error(expected) is None


def test_5xx_exhausts_retries_and_4xx_is_not_retried() -> None:
    fake = FakeSGLang(failures=10)

    async def body(client: SGLangClient) -> None:
        with pytest.raises(EngineError, match=r"POST http://127.0.0.1:\d+/generate failed after 3 attempts: HTTP 503"):
            await client.generate([1], SamplingParams())
        assert client.failures == 1
        fake.failures = 0
        with pytest.raises(EngineError, match=r"^/generate: input too long \(HTTP 400\)$"):
            await client.generate([0], SamplingParams())

    asyncio.run(with_server(fake, body))
    assert fake.paths == ["/generate"] * 4


def test_unreachable_server_is_a_counted_failure() -> None:
    async def body() -> None:
        async with SGLangClient("http://127.0.0.1:9", max_retries=1, backoff_s=0.01) as client:
            with pytest.raises(EngineError, match="failed after 2 attempts: ClientConnectorError"):
                await client.generate([1], SamplingParams())
            assert client.failures == 1
            assert await client.health(timeout_s=1) is False
            assert client.failures == 1

    asyncio.run(body())


def test_old_server_fallbacks_and_weight_errors() -> None:
    fake = FakeSGLang(failures=0)

    async def body(client: SGLangClient) -> dict:
        await client.begin_weight_update()  # 404: a server before weight-update sessions
        with pytest.raises(EngineError, match=r"^/update_weights_from_distributed: Failed to receive weights: boom"):
            await client.update_weights_from_distributed(["w"], ["float32"], [[2]], "g")
        await client.end_weight_update()  # skipped: the server has no sessions
        return await client.get_model_info()

    assert asyncio.run(with_server(fake, body)) == {"model_path": "/m"}
    assert fake.paths == ["/begin_weight_update", "/update_weights_from_distributed", "/model_info", "/get_model_info"]
    assert fake.bodies[1] == {
        "names": ["w"],
        "dtypes": ["float32"],
        "shapes": [[2]],
        "group_name": "g",
        "flush_cache": True,
    }
