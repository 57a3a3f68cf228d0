"""Reading and writing HF model directories: lazy safetensors access, sharded output that transformers loads."""

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.convert.hf_io import INDEX_FILE, HFWeights, metadata_files, save_hf_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("hf") / "qwen3", tokenizer="char")


def test_sharded_directory_loads_in_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    source = HFWeights(tiny_dir)
    out = save_hf_dir(tmp_path / "out", source.items(), tiny_dir, max_shard_bytes=200_000)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["weight_map"].keys() == set(source.keys())
    assert {p.name for p in metadata_files(out)} == {p.name for p in metadata_files(tiny_dir)}
    assert "tokenizer.json" in {p.name for p in metadata_files(out)}

    reread = HFWeights(out)
    assert all(torch.equal(reread[k], source[k]) for k in source.keys())  # noqa: SIM118 - HFWeights is not a dict
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    a = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    b = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_dtype_cast_is_recorded_in_config(tiny_dir: Path, tmp_path: Path) -> None:
    state = dict(HFWeights(tiny_dir).items())  # a state dict works as well as a stream of pairs
    out = save_hf_dir(tmp_path / "bf16", state, tiny_dir, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert HFWeights(out)["model.norm.weight"].dtype == torch.bfloat16
    assert not (out / INDEX_FILE).exists()  # one shard: a single model.safetensors


def test_missing_weights_and_names_are_reported(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape("has no model.safetensors or model.safetensors.index.json")):
        HFWeights(tmp_path)
    with pytest.raises(KeyError, match=re.escape("no tensor named 'lm_head.bias'")):
        HFWeights(tiny_dir)["lm_head.bias"]


def test_a_failed_write_leaves_no_partial_directory(tiny_dir: Path, tmp_path: Path) -> None:
    def broken():
        yield "model.norm.weight", torch.zeros(4)
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        save_hf_dir(tmp_path / "out", broken(), tiny_dir)
    assert list(tmp_path.iterdir()) == []


def test_exports_are_readable_like_any_model_directory(tiny_dir: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        out = save_hf_dir(tmp_path / "export", HFWeights(tiny_dir).items(), tiny_dir)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # not the 0700 of a temporary directory
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
