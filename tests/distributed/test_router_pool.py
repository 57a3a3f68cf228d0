"""`rollout.router: sglang` with two embedded engines on Ray: the pool's generation goes through the real
sglang-router (round robin spreads it over both engines), while pause and resume still go to each engine. The
router and both engines require the run's key (here a random one): a call without it gets 401. The router's model
list, which sglang-router 0.3.2 answers without the key, holds the checkpoint directory's name, not its path."""

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, RolloutConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.pool import RolloutPool
from userrl_megatron.fleet.router import list_workers
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError

pytestmark = pytest.mark.distributed


def test_pool_generates_through_the_router(ray_cluster: Any, tmp_path: Path) -> None:
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    model = make_tiny_model("llama", tmp_path / "tiny", seed=0, tokenizer="char")
    cfg = RolloutConfig(
        num_engines=2, router="sglang", health_check_interval_s=0, embedded=EmbeddedServerConfig(device="cpu")
    )
    greedy = SamplingParams(max_new_tokens=4, temperature=0)

    async def go() -> tuple[list[list[int]], list[int], list[str], list[str], bytes]:
        async with RolloutPool(cfg, str(model), log_dir=tmp_path / "engines") as pool:
            assert pool.router is not None
            assert list_workers(pool.router.url) == []  # the worker list needs the key too
            with urllib.request.urlopen(pool.router.url + "/v1/models", timeout=30) as unkeyed_list:
                models = unkeyed_list.read()
            workers = sorted(w["url"] for w in list_workers(pool.router.url, pool.api_key))
            for url in [pool.router.url, *pool.urls]:
                async with SGLangClient(url) as unkeyed:
                    with pytest.raises(EngineError, match="401"):
                        await unkeyed.generate([5, 6, 7], greedy)
            outputs = [(await pool.session(f"e{i}").generate([5, 6, 7], greedy)).output_ids for i in range(4)]
            await pool.pause()  # control calls go to the engines themselves
            await pool.resume()
            steps = []
            for client in pool.clients:
                info = await client._request("GET", "/server_info")
                steps.append(info[1]["internal_states"][0]["decode_steps"])
            return outputs, steps, workers, sorted(pool.urls), models

    outputs, steps, workers, urls, models = asyncio.run(go())
    assert [m["id"] for m in json.loads(models)["data"]] == ["tiny"]
    assert str(tmp_path).encode() not in models
    assert workers == urls
    assert all(o == outputs[0] for o in outputs) and len(outputs[0]) == 4
    assert all(s > 0 for s in steps)  # round robin: both engines generated
