"""Which tensors weight sync looks up and reads back on the engines (SGLang converts whole tensors to lists)."""

import torch

from userrl_megatron.sync.sender import READ_BACK_MAX_ELEMENTS, _worth_checking, name_pattern, sample_names


def test_name_pattern() -> None:
    assert name_pattern("model.layers.17.mlp.up_proj.weight") == "model.layers.N.mlp.up_proj.weight"
    assert name_pattern("model.norm.weight") == "model.norm.weight"


def test_one_lookup_per_pattern_and_no_huge_tensors() -> None:
    checked: set[str] = set()
    small, huge = torch.empty(4), torch.empty(1).expand(READ_BACK_MAX_ELEMENTS + 1)
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    assert [_worth_checking(n, small, checked) for n in names] == [True, False, True]
    assert not _worth_checking("model.embed_tokens.weight", huge, checked)


def test_sample_names_first_middle_last_of_each_pattern() -> None:
    names = ["model.embed_tokens.weight", *(f"model.layers.{i}.mlp.up_proj.weight" for i in range(5))]
    names += ["model.norm.weight", "lm_head.weight"]
    assert sample_names(names) == [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.4.mlp.up_proj.weight",
        "model.norm.weight",
    ]
