"""Pushed names are checked against the checkpoint each engine loaded, not by asking the engine: SGLang 0.5.23
answers `/get_weights_by_name` for few model classes (`sglang/srt/models/qwen3.py` and `qwen3_moe.py` define no
`get_weights_by_name`; `model_runner_components/weight_exporter.py:169-190` turns the AttributeError into None and
`entrypoints/http_server.py:1561-1570` into a 400 "Get parameter by name failed"), so a check that asked it stopped
the first push of every Qwen3 run."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.sync.sender import EngineEndpoint, UnknownWeightNameError
from userrl_megatron.sync.served import served_names
from userrl_megatron.sync.tensor_sender import TensorSender


class _Qwen3OnSGLang:
    """An engine as SGLang 0.5.23 serving Qwen3 answers the sender: updates accepted, no read-back by name."""

    def __init__(self) -> None:
        self.ended = self.loaded = 0
        self.asked: list[str] = []

    async def begin_weight_update(self) -> None: ...

    async def end_weight_update(self) -> None:
        self.ended += 1

    async def update_weights_from_tensor(self, *args: object, **kwargs: object) -> None:
        self.loaded += 1

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        from userrl_megatron.wire.generation import EngineError

        self.asked.append(name)
        raise EngineError("/get_weights_by_name: Get parameter by name failed (HTTP 400)")


def _checkpoint(folder: Path, shards: dict[str, list[str]]) -> Path:
    """A checkpoint of 2-element tensors, one safetensors file per shard, with an index when there are several."""
    folder.mkdir()
    for file, names in shards.items():
        save_file({n: torch.ones(2) for n in names}, folder / file)
    if len(shards) > 1:
        weight_map = {n: file for file, names in shards.items() for n in names}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_names_come_from_the_index_or_the_file_headers(tmp_path: Path) -> None:
    one = _checkpoint(tmp_path / "one", {"model.safetensors": ["a", "b"]})
    two = _checkpoint(tmp_path / "two", {"model-00001.safetensors": ["a"], "model-00002.safetensors": ["c"]})
    (tmp_path / "bin").mkdir()
    assert served_names(str(one)) == {"a", "b"}
    assert served_names(str(two)) == {"a", "c"}
    assert served_names(str(tmp_path / "bin")) is None and served_names("") is None


def test_a_damaged_header_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes((2**40).to_bytes(8, "little"))
    with pytest.raises(ValueError, match=r"model\.safetensors: a safetensors header of 1099511627776 bytes"):
        served_names(str(tmp_path / "bad"))


def _push(engine: _Qwen3OnSGLang, checkpoint: str, named: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    sender = TensorSender(
        SyncConfig(), [EngineEndpoint("http://e:1", checkpoint=checkpoint)], client_factory=lambda url: engine
    )
    sender.connect()
    try:
        return sender.push(named, version=1)
    finally:
        sender.close()


def test_a_model_without_read_back_takes_its_checkpoint_names(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "qwen3", {"model.safetensors": ["a", "b"]})
    engine = _Qwen3OnSGLang()
    metrics = _push(engine, str(ckpt), [("a", torch.ones(2)), ("b", torch.zeros(2))])
    assert metrics["sync/bytes"] == 16 and engine.loaded == 1 and engine.ended == 1
    assert engine.asked == []  # the engine is never asked


def test_a_name_the_checkpoint_lacks_fails_before_anything_is_loaded(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "qwen3", {"model.safetensors": ["a", "b"]})
    engine = _Qwen3OnSGLang()
    with pytest.raises(UnknownWeightNameError) as raised:
        _push(engine, str(ckpt), [("a", torch.ones(2)), ("decoder.final_layernorm.weight", torch.ones(2))])
    assert str(raised.value) == (
        f"the engine at http://e:1 has no weight named 'decoder.final_layernorm.weight' (its checkpoint {ckpt} holds "
        "none); the pushed names must be the engine model's Hugging Face parameter names"
    )
    assert engine.loaded == 0 and engine.ended == 1  # nothing sent; the failed push closed the session


def test_an_engine_of_unknown_checkpoint_is_pushed_to_unchecked_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _Qwen3OnSGLang()
    with caplog.at_level(logging.WARNING):
        _push(engine, str(tmp_path), [("anything", torch.ones(2))])
    assert engine.loaded == 1
    said = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert said == [
        "weight sync userrl_weight_sync: the names pushed to http://e:1 are not checked: its checkpoint "
        f"{str(tmp_path)!r} has no safetensors"
    ]
