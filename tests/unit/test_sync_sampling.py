"""Which tensors weight sync reads back from the engines (SGLang converts whole tensors to lists)."""

from userrl_megatron.sync.sender import name_pattern, sample_names


def test_name_pattern() -> None:
    assert name_pattern("model.layers.17.mlp.up_proj.weight") == "model.layers.N.mlp.up_proj.weight"
    assert name_pattern("model.norm.weight") == "model.norm.weight"


def test_sample_names_first_middle_last_of_each_pattern() -> None:
    names = ["model.embed_tokens.weight", *(f"model.layers.{i}.mlp.up_proj.weight" for i in range(5))]
    names += ["model.norm.weight", "lm_head.weight"]
    assert sample_names(names) == [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.4.mlp.up_proj.weight",
        "model.norm.weight",
    ]
