"""A refused weight update is fatal for that engine: `WeightSync.push` restarts it through the pool and
pushes the version again to every engine (real pool on Ray, one embedded engine, the project's sender)."""

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import make_tiny_model
from tests.support.trainer_side import StateDictActors
from userrl_megatron.config import load_config
from userrl_megatron.fleet.pool import RolloutPool
from userrl_megatron.trainer.components import Components

pytestmark = pytest.mark.distributed


def test_refusing_engine_is_restarted_and_synced(ray_cluster: Any, tmp_path: Path) -> None:
    a = make_tiny_model("llama", tmp_path / "a", seed=0, tokenizer="char")
    b = make_tiny_model("llama", tmp_path / "b", seed=1, tokenizer="char")
    state = dict(AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict())
    cfg = load_config(overrides=["rollout.health_check_interval_s=0", "rollout.embedded.device=cpu"], check=False)

    async def go() -> tuple[dict[str, float], int, str, str, list[Any]]:
        async with RolloutPool(cfg.rollout, str(a), log_dir=tmp_path / "engines") as pool:
            parts = Components(cfg, StateDictActors(state, cfg.sync), pool, None, None, [])
            pool.add_restart_hook(parts.weights.repair)
            await parts.weights.connect()
            first_url = pool.urls[0]
            # The engine loses its group: it refuses the next update at once and never joins the broadcast.
            await pool.clients[0].destroy_weights_update_group(parts.weights.groups[0])
            metrics = await parts.weights.push(1)
            (client,) = pool.clients
            info = await client.get_model_info()
            rows = await client.get_weights_by_name("model.norm.weight", truncate_size=4)
            await asyncio.to_thread(parts.actors.disconnect_engines, parts.weights.groups)
            return metrics, pool.engines[0].restarts, first_url, info["weight_version"], rows

    metrics, restarts, first_url, version, rows = asyncio.run(go())
    assert restarts == 1 and version == "1"
    assert metrics["sync/verify_max_rel_diff"] == 0.0  # the first sync, read back after the restart and re-push
    assert torch.equal(torch.tensor(rows), state["model.norm.weight"][:4])
    assert first_url.startswith("http://127.0.0.1:")
