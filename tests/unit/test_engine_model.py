"""EngineModel weight loading by HF name: tied embeddings, strict names and shapes, reading weights back."""

import pytest
import torch

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.server.model import EngineModel


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> EngineModel:
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("model") / "tied", tie_word_embeddings=True)
    return EngineModel(path)


def test_tied_embeddings_load_through_embed_tokens(tied: EngineModel) -> None:
    embed = torch.randn(256, 64)
    loaded = tied.load_weights([("model.embed_tokens.weight", embed), ("lm_head.weight", torch.zeros(256, 64))])
    assert loaded == 1  # lm_head.weight is skipped: it is the embedding
    assert torch.equal(tied.model.lm_head.weight, embed) and torch.equal(tied.model.model.embed_tokens.weight, embed)
    assert tied.get_weights_by_name("lm_head.weight", truncate_size=2) == embed[:2].tolist()
    assert tied.spec.tie_word_embeddings and tied.spec.model_type == "qwen3"


def test_bf16_tensors_are_cast_and_bad_tensors_refused(tied: EngineModel) -> None:
    norm = torch.randn(64).to(torch.bfloat16)
    assert tied.load_weights([("model.norm.weight", norm), ("model.layers.0.self_attn.rotary_emb.inv_freq", norm)]) == 1
    assert torch.equal(tied.model.model.norm.weight, norm.float())
    with pytest.raises(KeyError, match=r"unknown parameter 'model\.layers\.9\.mlp\.up_proj\.weight'"):
        tied.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"^model.norm.weight: shape \(63,\) does not match \(64,\)$"):
        tied.load_weights([("model.norm.weight", torch.zeros(63))])
    assert tied.get_weights_by_name("nope") is None


def test_receive_target_is_the_parameter_only_where_loading_would_copy(tied: EngineModel) -> None:
    cpu, norm = torch.device("cpu"), tied.model.model.norm.weight
    target = tied.receive_target("model.norm.weight", torch.float32, (64,), cpu)
    assert target is not None and target.data_ptr() == norm.data_ptr() and target.shape == norm.shape
    refused = {
        "other dtype (load casts)": ("model.norm.weight", torch.bfloat16, (64,), cpu),
        "other shape (load refuses)": ("model.norm.weight", torch.float32, (63,), cpu),
        "other device": ("model.norm.weight", torch.float32, (64,), torch.device("meta")),
        "unknown name": ("model.layers.9.mlp.up_proj.weight", torch.float32, (64,), cpu),
        "skipped suffix": ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.float32, (64,), cpu),
        "tied head (the embedding)": ("lm_head.weight", torch.float32, (256, 64), cpu),
    }
    for what, args in refused.items():
        assert tied.receive_target(*args) is None, what
