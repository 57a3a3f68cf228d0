"""`userrl convert hf2mcore|mcore2hf`: HF -> Megatron -> HF is bit-exact, and the result loads in transformers."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.distributed import hf_logprobs, init_world, max_abs_diff, megatron_config, spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.cli import main
from userrl_megatron.convert.hf_io import HFWeights, metadata_files
from userrl_megatron.model_store import resolve_model
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed


def assert_same_model(original: Path, converted: Path) -> None:
    """Bit-identical tensors, the same non-weight files, and equal logits in transformers."""
    a, b = HFWeights(original), HFWeights(converted)
    assert set(a.keys()) == set(b.keys())
    for name in a.keys():  # noqa: SIM118 - HFWeights is not a dict
        assert torch.equal(a[name], b[name]), name
    assert [p.name for p in metadata_files(original)] == [p.name for p in metadata_files(converted)]
    ids = torch.tensor([[1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(original).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(converted).eval()(ids).logits
    assert torch.equal(want, got)


def round_trip(hf: Path, work: Path, to_mcore: list[str], to_hf: list[str]) -> Path:
    ckpt, out = work / "mcore", work / "hf"
    assert main(["convert", "hf2mcore", "--hf", str(hf), "--out", str(ckpt), *to_mcore]) == 0
    assert not (work / "latest").exists()  # hf2mcore writes only under --out
    assert main(["convert", "mcore2hf", "--ckpt", str(ckpt), "--out", str(out), *to_hf]) == 0
    return out


def test_round_trip_tp2_untied_qwen2(tmp_path: Path) -> None:
    hf = make_tiny_model("qwen2", tmp_path / "qwen2", seed=8, tokenizer="char")
    out = round_trip(hf, tmp_path, ["--tp", "2"], [])
    assert_same_model(hf, out)
    assert AutoTokenizer.from_pretrained(out)("hello").input_ids == AutoTokenizer.from_pretrained(hf)("hello").input_ids


def test_round_trip_pp2_then_tp2_tied_llama_with_padded_vocab(tmp_path: Path) -> None:
    hf = make_tiny_model("llama", tmp_path / "llama", seed=9, tie_word_embeddings=True, vocab_size=250)
    out = round_trip(hf, tmp_path, ["--pp", "2"], ["--tp", "2"])
    assert_same_model(hf, out)
    assert "lm_head.weight" not in HFWeights(out)


def test_conversion_errors_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = make_tiny_model("qwen3", tmp_path / "qwen3", seed=1)
    assert main(["convert", "hf2mcore", "--hf", str(hf), "--out", str(tmp_path / "x"), "--tp", "4"]) == 2
    assert "tensor_model_parallel_size = 4 must divide the model's 2 key/value heads" in capsys.readouterr().err
    assert main(["convert", "mcore2hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert f"{tmp_path} is neither a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.slow
def test_smollm2_round_trip_at_tp3(tmp_path: Path) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, tied): both converters at TP=3; logits equal in transformers."""
    hf = resolve_model("smollm2-135m-instruct")
    out = round_trip(hf, tmp_path, ["--tp", "3"], ["--tp", "3"])
    assert_same_model(hf, out)


def _smollm2_logprobs(rank: int, world: int, port: int, seqs: list[list[int]]) -> list[list[float]]:
    from tests.support.distributed import build_actor

    cfg = megatron_config(tp=3, micro_batch_tokens=256)
    init_world(rank, world, port, cfg)
    actor = build_actor(resolve_model("smollm2-135m-instruct"), cfg)
    return actor.compute_logprobs(TrainBatch(seqs, [], []))


@pytest.mark.slow
def test_smollm2_logprobs_at_tp3_match_transformers() -> None:
    hf = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(hf)
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi!"]
    seqs = [tok(t).input_ids for t in texts]
    results = spawn(_smollm2_logprobs, 3, seqs)
    assert max_abs_diff(results[0], hf_logprobs(hf, seqs)) <= 5e-5  # 30 fp32 layers: measured 2.1e-5
    assert results[1] == results[0] == results[2]
