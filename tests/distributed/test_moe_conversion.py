"""`userrl convert` for Qwen3-MoE: HF -> Megatron (sharded over EP / PP / TP) -> HF is bit-exact, and an
expert-parallel checkpoint holds each expert where Megatron expects it."""

from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from userrl_megatron.cli import main
from userrl_megatron.convert.hf_io import HFWeights

pytestmark = pytest.mark.distributed


def round_trip(hf: Path, work: Path, to_mcore: list[str], to_hf: list[str]) -> Path:
    ckpt, out = work / "mcore", work / "hf"
    assert main(["convert", "hf2mcore", "--hf", str(hf), "--out", str(ckpt), *to_mcore]) == 0
    assert main(["convert", "mcore2hf", "--ckpt", str(ckpt), "--out", str(out), *to_hf]) == 0
    return out


def assert_bit_identical(original: Path, converted: Path) -> None:
    a, b = HFWeights(original), HFWeights(converted)
    assert set(a.keys()) == set(b.keys())
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in set(a.keys())
    for name in a.keys():  # noqa: SIM118 - HFWeights is not a dict
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    ("to_mcore", "to_hf"),
    [
        (["--ep", "2"], []),  # experts 0-3 on EP rank 0, 4-7 on EP rank 1; exported on one rank
        (["--pp", "2"], ["--ep", "2"]),  # a PP checkpoint loaded and exported under EP = 2 (gathered over EP)
    ],
)
def test_round_trip_is_bit_exact(tmp_path: Path, to_mcore: list[str], to_hf: list[str]) -> None:
    hf = make_tiny_model(MOE_FAMILY, tmp_path / "moe", seed=5)
    assert_bit_identical(hf, round_trip(hf, tmp_path, to_mcore, to_hf))


@pytest.mark.slow
def test_round_trip_tp2_ep2_then_tp2_pp2(tmp_path: Path) -> None:
    hf = make_tiny_model(MOE_FAMILY, tmp_path / "moe", seed=6)
    assert_bit_identical(hf, round_trip(hf, tmp_path, ["--tp", "2", "--ep", "2"], ["--tp", "2", "--pp", "2"]))


def test_expert_parallel_sizes_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = make_tiny_model(MOE_FAMILY, tmp_path / "moe", seed=1)
    assert main(["convert", "hf2mcore", "--hf", str(hf), "--out", str(tmp_path / "x"), "--ep", "3"]) == 2
    assert "expert_model_parallel_size = 3 must divide the model's 8 experts (num_experts)" in capsys.readouterr().err
    dense = make_tiny_model("qwen3", tmp_path / "dense", seed=1)
    assert main(["convert", "hf2mcore", "--hf", str(dense), "--out", str(tmp_path / "y"), "--ep", "2"]) == 2
    assert "needs a mixture-of-experts model; qwen3 is dense" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
