"""The embedded engine's attention (`server/attention.py`): a padded prefill of a grouped-query model on CPU gives
transformers' SDPA numbers without repeating the KV heads, and the LM head's strided input gives the logits of a
contiguous one."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.server import attention
from userrl_megatron.server.model import EngineModel


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("attention") / "gqa", num_attention_heads=4,
                           num_key_value_heads=2)  # fmt: skip


def test_a_padded_prefill_equals_transformers_sdpa_without_repeating_kv_heads(
    tiny_gqa: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = EngineModel(tiny_gqa)
    assert engine.model.config._attn_implementation == attention.NAME
    reference = AutoModelForCausalLM.from_pretrained(tiny_gqa, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([[0, 0, 5, 9, 3, 7], [4, 8, 2, 6, 1, 9], [0, 0, 0, 0, 11, 12]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0], [4]])).long()
    positions = (torch.cumsum(mask, dim=1) - 1).clamp(min=0)
    repeats: list[int] = []
    repeat = torch.Tensor.reshape

    def counted(self: torch.Tensor, *shape: object) -> torch.Tensor:  # transformers' repeat_kv ends in a reshape
        if self.dim() == 5 and self.stride(2) == 0:
            repeats.append(1)
        return repeat(self, *shape)

    monkeypatch.setattr(torch.Tensor, "reshape", counted)
    with torch.no_grad():
        got = engine.forward(ids, positions, cache=None, attention_mask=mask, all_logits=True)
        assert repeats == []  # the engine's forward repeated no KV head
        want = reference(input_ids=ids, position_ids=positions, attention_mask=mask).logits
    assert repeats  # transformers' did, in every layer
    valid = mask.bool()
    assert torch.equal(got[valid], want[valid])


def test_the_heads_strided_input_gives_the_logits_of_a_contiguous_one(tiny_gqa: Path) -> None:
    engine = EngineModel(tiny_gqa)
    head = engine.model.get_output_embeddings()
    hidden = torch.randn(5, 7, engine.model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(head(hidden[:, -1:, :]), head(hidden[:, -1:, :].clone()))
