"""The export colocated tensor-handle sync uses when an engine sits on a device of another data-parallel replica:
with `everywhere`, every rank of the stage (data-parallel rank 1 too) yields every tensor, experts gathered over
EP included, so it can hand the engine on its own GPU its own copy (issue 27: engines on the second node of a
multi-node colocated layout mapped memory of rank 0, on the first node). Without it, only the source yields."""

from pathlib import Path
from typing import Any

import pytest

from tests.support.distributed import build_actor, init_world, megatron_config, spawn
from tests.support.tiny_models import MOE_FAMILY, make_tiny_model

pytestmark = pytest.mark.distributed


def _export(rank: int, world: int, port: int, dense_dir: str, moe_dir: str) -> dict[str, Any]:
    out = {}
    for kind, model_dir, ep in (("dense", dense_dir, 1), ("moe", moe_dir, 2)):
        cfg = megatron_config(devices_per_node=world, expert_model_parallel_size=ep)  # TP1 x DP2 (EP2 over DP2)
        init_world(rank, world, port, cfg)
        actor = build_actor(Path(model_dir), cfg)
        everywhere = [(name, float(t.double().sum())) for name, t in actor.export_hf_weights(everywhere=True)]
        source_only = [name for name, _ in actor.export_hf_weights()]
        out[kind] = (everywhere, source_only)
    return out


def test_every_data_parallel_rank_yields_the_whole_stage(tmp_path: Path) -> None:
    dense = make_tiny_model("qwen3", tmp_path / "dense", seed=0)
    moe = make_tiny_model(MOE_FAMILY, tmp_path / "moe", seed=0, hidden_size=128, moe_intermediate_size=64, head_dim=32)
    rank0, rank1 = spawn(_export, 2, str(dense), str(moe))
    for kind in ("dense", "moe"):
        everywhere0, source0 = rank0[kind]
        everywhere1, source1 = rank1[kind]
        assert everywhere1 == everywhere0  # the same names, in the same order, with the same values
        assert [name for name, _ in everywhere0] == source0
        assert source1 == []
    experts = {int(name.split(".")[5]) for name, _ in rank1["moe"][0] if ".mlp.experts." in name}
    assert experts == set(range(8))  # rank 1 holds experts 4-7 and gathered 0-3 over EP
