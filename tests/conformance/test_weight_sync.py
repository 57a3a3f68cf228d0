"""Weight sync on both backends with the project's `WeightSender`: flattened buckets of mixed dtypes and the
per-tensor format, weights read back by name, generation with the new weights, the weight version, groups
destroyed on both sides (a name can be reused), and every refusal: unknown names, wrong shapes, unknown groups,
updates outside a weight-update session."""

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conformance.conftest import Engine, read_back, run
from tests.conformance.test_generate import chat_ids
from tests.support.engine_ref import hf_greedy
from tests.support.servers import push_weights
from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.fleet.engine import EngineError, SGLangClient
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import EngineEndpoint, UnknownWeightNameError, WeightSender, WeightUpdateRefusedError
from userrl_megatron.types import SamplingParams


async def weight_version(url: str) -> str:
    async with SGLangClient(url) as client:
        return str((await client.get_model_info())["weight_version"])


BOTH_FORMATS = pytest.mark.parametrize("sender", [True, False], ids=["direct", "packed"], indirect=True)


@pytest.fixture
def sender(engine: Engine, request: pytest.FixtureRequest) -> Iterator[WeightSender]:
    """A connected sender with 1 MB buckets (several buckets per push); `sync.direct` from the test's parameter
    (large tensors broadcast from their own memory), on when not parametrized; closed after the test."""
    cfg = SyncConfig(bucket_mb=1, direct=getattr(request, "param", True))
    sender = WeightSender(cfg, [EngineEndpoint(engine.url)], f"conformance_{free_port()}")
    sender.connect("127.0.0.1", free_port())
    yield sender
    sender.close()


@BOTH_FORMATS
def test_buckets_of_mixed_dtypes_load_and_read_back(
    engine: Engine, sender: WeightSender, originals: dict[str, torch.Tensor], hf: Any, smol_dir: Any
) -> None:
    changed = {
        "model.layers.0.mlp.down_proj.weight": originals["model.layers.0.mlp.down_proj.weight"] * 0.5,
        "model.layers.1.self_attn.q_proj.weight": (originals["model.layers.1.self_attn.q_proj.weight"] * -1).bfloat16(),
        "model.norm.weight": originals["model.norm.weight"] + 0.25,
    }
    metrics = sender.push(list(changed.items()), version=7)
    # Each tensor alone: 1 MB buckets, and the dtype changes between them; with `direct`, down_proj (3.5 MB) is
    # broadcast from its own memory in SGLang's per-tensor format, the others are packed.
    assert metrics["sync/buckets"] == 3
    down = changed["model.layers.0.mlp.down_proj.weight"]
    assert metrics["sync/direct_bytes"] == (down.numel() * 4 if sender.cfg.direct else 0)
    got = run(read_back(engine.url, list(changed)))
    for name, tensor in changed.items():
        assert torch.equal(got[name], tensor[:2].float()), name
    assert run(weight_version(engine.url)) == "7"
    with torch.no_grad():
        for name, tensor in changed.items():
            hf.get_parameter(name).copy_(tensor.float())
    prompt = chat_ids(smol_dir)

    async def generate() -> Any:
        async with SGLangClient(engine.url) as client:
            await client.flush_cache()
            return await client.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))

    generation = run(generate())
    assert generation.output_ids == hf_greedy(hf, prompt, 4) and generation.weight_version == "7"


def test_per_tensor_format(engine: Engine, originals: dict[str, torch.Tensor]) -> None:
    tensors = [("model.norm.weight", originals["model.norm.weight"] * 2), ("model.layers.0.mlp.down_proj.weight",
               originals["model.layers.0.mlp.down_proj.weight"].bfloat16())]  # fmt: skip

    async def go() -> None:
        async with SGLangClient(engine.url) as client:
            await push_weights(client, tensors, f"per_tensor_{free_port()}", load_format=None, weight_version="8")

    run(go())
    got = run(read_back(engine.url, [n for n, _ in tensors]))
    assert all(torch.equal(got[n], t[:2].float()) for n, t in tensors)
    assert run(weight_version(engine.url)) == "8"


def test_close_destroys_the_group_on_the_engine_so_its_name_can_be_reused(engine: Engine, hf: Any) -> None:
    name = f"reused_{free_port()}"
    norm = hf.get_parameter("model.norm.weight").detach().clone()
    for version in (1, 2):
        sender = WeightSender(SyncConfig(), [EngineEndpoint(engine.url)], name)
        sender.connect("127.0.0.1", free_port())
        sender.push([("model.norm.weight", norm)], version=version)
        sender.close()

    async def destroy_again() -> None:
        async with SGLangClient(engine.url) as client:
            await client.destroy_weights_update_group(name)

    with pytest.raises(EngineError, match="The group to be destroyed does not exist"):
        run(destroy_again())


def test_unknown_name_fails_before_anything_is_sent(engine: Engine, sender: WeightSender) -> None:
    # SGLang 0.5.23 would answer success, bump its version and load nothing.
    before = run(weight_version(engine.url))
    with pytest.raises(UnknownWeightNameError, match=r"has no weight named 'decoder\.final_layernorm\.weight'"):
        sender.push([("decoder.final_layernorm.weight", torch.ones(576))], version=99)
    assert run(weight_version(engine.url)) == before


@BOTH_FORMATS
def test_wrong_shape_is_refused_and_named(
    engine: Engine, sender: WeightSender, originals: dict[str, torch.Tensor]
) -> None:
    # The name check passes; the engine receives the bucket (or the direct batch: 1 MiB), fails to load it (SGLang
    # after overwriting part of the weights) and answers 400: the sender reports the engine, whose weights must be
    # treated as corrupt.
    with pytest.raises(WeightUpdateRefusedError) as refused:
        sender.push([("model.norm.weight", torch.ones(2**18))], version=98)
    assert refused.value.urls == [engine.url]
    assert "weight update refused by 1 of 1 engines" in str(refused.value)


def test_refusal_before_the_broadcast_aborts_it(engine: Engine, sender: WeightSender) -> None:
    # The engine no longer has the group: it refuses at once and never joins the broadcast, which would otherwise
    # keep the sender waiting for the group timeout (30 min).
    async def drop_group() -> None:
        async with SGLangClient(engine.url) as client:
            await client.destroy_weights_update_group(sender.group_name)

    run(drop_group())
    norm = torch.ones(576)
    with pytest.raises(WeightUpdateRefusedError, match=r"refused by 1 of 1 engines .*model\.norm\.weight"):
        sender.push([("model.norm.weight", norm)], version=97)
    with pytest.raises(RuntimeError, match="was abandoned after a refusal; reconnect"):
        sender.push([("model.norm.weight", norm)], version=96)


def test_update_outside_a_session_is_refused(engine: Engine) -> None:
    async def go() -> None:
        async with SGLangClient(engine.url) as client:
            await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[576]], "none")

    with pytest.raises(EngineError, match=r"must run between begin_weight_update\(\) and end_weight_update\(\)"):
        run(go())
