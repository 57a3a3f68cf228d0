"""Colocated weight sync (`TensorSender`, SGLang's `/update_weights_from_tensor`) on both backends: buckets of
mixed dtypes handed over as shared-memory handles, read back bit-exact by name, generation with the new weights,
the weight version, the sender's two shared-memory segments reused across pushes (as a GPU sender's: dropped after
each) and removed when it closes; the refusals both backends share. Real SGLang 0.5.23 dies on a wrong shape or an
unknown load format on this path (the embedded server refuses those instead: tests/e2e/test_server_http.py), so no
test here sends one."""

import base64
import os
import subprocess
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conformance.conftest import Engine, read_back, run
from tests.conformance.test_generate import chat_ids
from tests.support.engine_ref import hf_greedy
from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.fleet.engine import EngineError, SGLangClient
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON
from userrl_megatron.ports import free_port
from userrl_megatron.sync.handles import decode_payload
from userrl_megatron.sync.sender import EngineEndpoint, UnknownWeightNameError
from userrl_megatron.sync.tensor_sender import TensorSender
from userrl_megatron.types import SamplingParams


def our_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


@pytest.fixture
def sender(engine: Engine) -> Iterator[TensorSender]:
    """A tensor-handle sender with 1 MB buckets (several buckets per push)."""
    sender = TensorSender(SyncConfig(bucket_mb=1), [EngineEndpoint(engine.url)], f"tensor_{free_port()}")
    sender.connect()
    yield sender
    sender.close()


def test_buckets_through_handles_load_bit_exact_through_reused_segments(
    engine: Engine, sender: TensorSender, originals: dict[str, torch.Tensor], hf: Any, smol_dir: Any
) -> None:
    changed = {
        "model.layers.0.mlp.down_proj.weight": originals["model.layers.0.mlp.down_proj.weight"] * 0.5 + 1e-3,
        "model.layers.1.self_attn.q_proj.weight": (originals["model.layers.1.self_attn.q_proj.weight"] * -1).bfloat16(),
        "model.norm.weight": originals["model.norm.weight"] + 0.25,
    }
    before = our_segments()
    sender.push([(name, tensor * 3) for name, tensor in changed.items()], version=10)
    kept = our_segments() - before
    assert len(kept) == 2  # two segments, alternating: the third bucket rewrote the first one's after it landed
    metrics = sender.push(list(changed.items()), version=11)
    assert our_segments() - before == kept  # written in place again, no new file
    assert metrics["sync/buckets"] == 3  # each tensor alone: 1 MB buckets, and the dtype changes between them
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in changed.values())
    sender.keep_segments = False  # a GPU sender's: the segments last one push, dropped after `end_weight_update`
    sender.push(list(changed.items()), version=12)
    assert our_segments() == before
    got = run(read_back(engine.url, list(changed), rows=4))
    for name, tensor in changed.items():
        assert torch.equal(got[name], tensor[:4].float()), name

    async def generate() -> Any:
        async with SGLangClient(engine.url) as client:
            await client.flush_cache()
            return await client.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))

    with torch.no_grad():
        for name, tensor in changed.items():
            hf.get_parameter(name).copy_(tensor.float())
    prompt = chat_ids(smol_dir)
    generation = run(generate())
    assert generation.output_ids == hf_greedy(hf, prompt, 4) and generation.weight_version == "12"


def test_whole_model_in_one_bucket_reads_back(engine: Engine, hf: Any) -> None:
    # The export order of a real sync (tied embeddings: no lm_head), 600 MB buckets: one bucket of the model.
    state = [(n, t.detach()) for n, t in hf.state_dict().items() if n != "lm_head.weight"]
    sender = TensorSender(SyncConfig(bucket_mb=600), [EngineEndpoint(engine.url)], f"whole_{free_port()}")
    sender.connect()
    before = our_segments()
    try:
        metrics = sender.push(state, version=12)
        assert len(our_segments() - before) == 1 and metrics["sync/buckets"] == 1
    finally:
        sender.close()
    assert our_segments() == before  # closing the sender removed its file
    names = ["model.embed_tokens.weight", "model.layers.29.mlp.up_proj.weight", "model.norm.weight"]
    got = run(read_back(engine.url, names, rows=3))
    assert all(torch.equal(got[n], hf.get_parameter(n)[:3].detach()) for n in names)


def test_unknown_name_fails_before_anything_is_sent(engine: Engine, sender: TensorSender) -> None:
    # SGLang 0.5.23 accepts an unknown name on this path too: success, nothing loaded.
    async def version() -> str:
        async with SGLangClient(engine.url) as client:
            return str((await client.get_model_info())["weight_version"])

    before = run(version())
    with pytest.raises(UnknownWeightNameError, match=r"has no weight named 'decoder\.final_layernorm\.weight'"):
        sender.push([("decoder.final_layernorm.weight", torch.ones(576))], version=99)
    assert run(version()) == before


def test_refusals_both_backends_give(engine: Engine) -> None:
    payload = base64.b64encode(b"\x80\x04N.").decode()  # a pickle of None: never read without a session

    async def go(body: list[str]) -> None:
        async with SGLangClient(engine.url) as client:
            await client.update_weights_from_tensor(body, load_format="flattened_bucket")

    with pytest.raises(EngineError, match=r"must run between begin_weight_update\(\) and end_weight_update\(\)"):
        run(go([payload]))
    with pytest.raises(EngineError, match=r"(?s)HTTP 400.*Expected base64-encoded bytes|Expected base64.*HTTP 400"):
        run(go(["!!! not base64"]))


SGLANG_WRITER = textwrap.dedent(
    """
    import sys, torch, torch.multiprocessing
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    torch.multiprocessing.set_sharing_strategy("file_system")  # shared by name: an unrelated process maps it
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(2).half())]
    bucket = FlattenedTensorBucket(named_tensors=named)
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    print(MultiprocessingSerializer.serialize(payload, output_str=True), flush=True)
    sys.stdin.readline()  # keep the memory alive until the reader is done
    """
)


def test_embedded_decoder_reads_a_payload_written_by_sglang() -> None:
    # What verl and slime send: SGLang's own FlattenedTensorBucket and metadata class (resolved to a stand-in).
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    writer = subprocess.Popen(
        [str(SGLANG_VENV_PYTHON), "-c", SGLANG_WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        (a, ta), (b, tb) = decode_payload([writer.stdout.readline().strip()], "flattened_bucket")
        assert (a, b) == ("a", "b")
        assert torch.equal(ta, torch.arange(6.0).reshape(2, 3)) and torch.equal(tb, torch.ones(2).half())
        writer.stdin.write("done\n")
        writer.stdin.flush()
        assert writer.wait(timeout=600) == 0  # it exits once told: only a hang takes longer
    finally:
        if writer.poll() is None:
            writer.kill()


def test_the_launcher_knows_the_servers_own_shared_memory_files(engine: Engine) -> None:
    # SGLang keeps a load-report file in /dev/shm that it removes only on a clean exit; the launcher records it once
    # the server is healthy and removes it when it stops the server (a killed one too: tests/unit/test_launch.py).
    files = engine.server.shm_files
    if engine.backend == "embedded":
        assert files == []
    else:
        assert [f.name.startswith("sglang_loads_") and f.exists() for f in files] == [True]
