"""Weight sync on every engine (both backends, each model) with the project's `WeightSender`, names checked against
the engine's checkpoint as in a run: flattened buckets of mixed dtypes and the per-tensor format, the weights
checked exactly (read back by name, or by SGLang's weights checker where its model class cannot read back),
generation with the new weights, the weight version, groups destroyed on both sides (a name can be reused), and
every refusal: unknown names, wrong shapes, unknown groups, updates outside a weight-update session."""

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conformance.conftest import Engine, expected_mismatches, mismatches, run
from tests.conformance.test_generate import chat_ids
from tests.support.engine_ref import hf_greedy
from tests.support.servers import http_call, push_weights
from tests.support.sglang_weights import engine_checksums, sglang_params
from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import UnknownWeightNameError, WeightSender, WeightUpdateRefusedError
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError


async def weight_version(url: str) -> str:
    async with SGLangClient(url) as client:
        return str((await client.get_model_info())["weight_version"])


BOTH_FORMATS = pytest.mark.parametrize("sender", [True, False], ids=["direct", "packed"], indirect=True)


@pytest.fixture
def sender(engine: Engine, request: pytest.FixtureRequest) -> Iterator[WeightSender]:
    """A connected sender with 1 MB buckets (several buckets per push); `sync.direct` from the test's parameter
    (large tensors broadcast from their own memory), on when not parametrized; closed after the test."""
    cfg = SyncConfig(bucket_mb=1, direct=getattr(request, "param", True))
    sender = WeightSender(cfg, [engine.endpoint()], f"conformance_{free_port()}")
    sender.connect("127.0.0.1", free_port())
    yield sender
    sender.close()


def changes(originals: dict[str, torch.Tensor], names: tuple[str, ...], shift: float = 0.0) -> dict[str, torch.Tensor]:
    """New values of the changed tensors (`Engine.changed`): the large one halved, the attention projection
    negated in bfloat16, the others (an MLP tensor, the norm) moved by 0.25; `shift` added to the first."""
    large, attention, *rest = names
    return {
        large: originals[large] * 0.5 + shift,
        attention: (originals[attention] * -1).bfloat16(),
        **{name: originals[name] + 0.25 for name in rest},
    }


@BOTH_FORMATS
def test_buckets_of_mixed_dtypes_load_and_read_back(
    engine: Engine, sender: WeightSender, originals: dict[str, torch.Tensor]
) -> None:
    changed = changes(originals, engine.changed)
    metrics = sender.push(list(changed.items()), version=7)
    # 1 MB buckets, and the dtype changes between the tensors: the large one alone (SmolLM2's down_proj, 3.5 MB;
    # the tiny models' lm_head), the bfloat16 one alone, the rest (the norm, and the tiny models' MLP tensor
    # before it) together; with `direct`, the large one is broadcast from its own memory in SGLang's per-tensor
    # format, the others are packed.
    assert metrics["sync/buckets"] == 3
    large = changed[engine.changed[0]]
    assert metrics["sync/direct_bytes"] == (large.numel() * 4 if sender.cfg.direct else 0)
    # The engine holds what was pushed: not the reference's weights in exactly the pushed tensors, then the
    # reference's once it holds them too.
    assert mismatches(engine, list(changed)) == expected_mismatches(engine, list(changed))
    with torch.no_grad():
        for name, tensor in changed.items():
            engine.tensor(name).copy_(tensor.float())
    assert mismatches(engine, list(changed)) == set()
    assert run(weight_version(engine.url)) == "7"
    hf, prompt = engine.hf, chat_ids(engine.model_dir)

    async def generate() -> Any:
        async with SGLangClient(engine.url) as client:
            await client.flush_cache()
            return await client.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))

    generation = run(generate())
    assert generation.output_ids == hf_greedy(hf, prompt, 4) and generation.weight_version == "7"


def test_per_tensor_format(engine: Engine, originals: dict[str, torch.Tensor]) -> None:
    norm, mlp = "model.norm.weight", next(n for n in engine.changed if ".mlp." in n)
    tensors = [(norm, originals[norm] * 2), (mlp, (originals[mlp] * 3).bfloat16())]

    async def go() -> None:
        async with SGLangClient(engine.url) as client:
            await push_weights(client, tensors, f"per_tensor_{free_port()}", load_format=None, weight_version="8")

    run(go())
    with torch.no_grad():
        for name, tensor in tensors:
            engine.tensor(name).copy_(tensor.float())
    assert mismatches(engine, [n for n, _ in tensors]) == set()
    assert run(weight_version(engine.url)) == "8"


def test_close_destroys_the_group_on_the_engine_so_its_name_can_be_reused(engine: Engine) -> None:
    name = f"reused_{free_port()}"
    norm = engine.tensor("model.norm.weight").detach().clone()
    for version in (1, 2):
        sender = WeightSender(SyncConfig(), [engine.endpoint()], name)
        sender.connect("127.0.0.1", free_port())
        sender.push([("model.norm.weight", norm)], version=version)
        sender.close()

    async def destroy_again() -> None:
        async with SGLangClient(engine.url) as client:
            await client.destroy_weights_update_group(name)

    with pytest.raises(EngineError, match="The group to be destroyed does not exist"):
        run(destroy_again())


def test_unknown_name_fails_before_anything_is_sent(engine: Engine, sender: WeightSender) -> None:
    # SGLang 0.5.23 would answer success, bump its version and load nothing. The name is checked against the
    # checkpoint the engine loaded (sync/served.py), on every model: SGLang's Qwen3 cannot be asked.
    before = run(weight_version(engine.url))
    hidden = engine.hf.config.hidden_size
    with pytest.raises(UnknownWeightNameError, match=r"has no weight named 'decoder\.final_layernorm\.weight'"):
        sender.push([("decoder.final_layernorm.weight", torch.ones(hidden))], version=99)
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
    norm = torch.ones(engine.hf.config.hidden_size)
    with pytest.raises(WeightUpdateRefusedError, match=r"refused by 1 of 1 engines .*model\.norm\.weight"):
        sender.push([("model.norm.weight", norm)], version=97)
    with pytest.raises(RuntimeError, match="was abandoned after a refusal; reconnect"):
        sender.push([("model.norm.weight", norm)], version=96)


def test_update_outside_a_session_is_refused(engine: Engine) -> None:
    hidden = engine.hf.config.hidden_size

    async def go() -> None:
        async with SGLangClient(engine.url) as client:
            await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[hidden]], "none")

    with pytest.raises(EngineError, match=r"must run between begin_weight_update\(\) and end_weight_update\(\)"):
        run(go())


def test_weights_are_checked_by_name_or_by_checksum(engine: Engine) -> None:
    """Which read-back each engine gives: by name on the embedded server and SGLang's Llama; SGLang 0.5.23's Qwen3
    and Qwen3-MoE refuse it (no `get_weights_by_name`: model_runner_components/weight_exporter.py:169-188, answered
    as 400 "Get parameter by name failed" at entrypoints/http_server.py:1559-1568), and their weights checker then
    names exactly the parameters the reference's state maps onto, each with the checksum of the loaded checkpoint."""
    by_name = engine.backend == "embedded" or engine.hf.config.architectures == ["LlamaForCausalLM"]
    assert engine.reads_by_name == by_name
    if by_name:
        return
    status, body = http_call(engine.url, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 1})
    assert (status, "Get parameter by name failed" in str(body)) == (400, True), (status, body)
    assert set(engine_checksums(engine.url)) == set(sglang_params(engine.state()))
    assert mismatches(engine, []) == set()
