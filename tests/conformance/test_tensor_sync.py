"""Colocated weight sync (`TensorSender`, SGLang's `/update_weights_from_tensor`) on every engine (both backends,
each model), names checked against the engine's checkpoint as in a run: buckets of mixed dtypes handed over as
shared-memory handles (in the embedded engine's own format to it, SGLang's pickle to SGLang), checked bit-exact
(read back by name, or by SGLang's weights checker where its model class cannot read back), generation with the
new weights, the weight version, the sender's two shared-memory segments reused across pushes (as a GPU sender's:
dropped after each) and removed when it closes; the refusals both backends share. Real SGLang 0.5.23 dies on a
wrong shape or an unknown load format on this path (the embedded server refuses those instead:
tests/e2e/test_server_http.py), so no test here sends one."""

import base64
import os
import subprocess
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conformance.conftest import Engine, expected_mismatches, mismatches, run
from tests.conformance.test_generate import chat_ids
from tests.conformance.test_weight_sync import changes
from tests.support.engine_ref import hf_greedy
from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import UnknownWeightNameError
from userrl_megatron.sync.tensor_sender import TensorSender
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError
from userrl_megatron.wire.receive import decode_payload


def our_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


@pytest.fixture
def sender(engine: Engine) -> Iterator[TensorSender]:
    """A tensor-handle sender with 1 MB buckets (several buckets per push)."""
    sender = TensorSender(SyncConfig(bucket_mb=1), [engine.endpoint()], f"tensor_{free_port()}")
    sender.connect()
    yield sender
    sender.close()


def test_buckets_through_handles_load_bit_exact_through_reused_segments(
    engine: Engine, sender: TensorSender, originals: dict[str, torch.Tensor]
) -> None:
    changed = changes(originals, engine.changed, shift=1e-3)
    before = our_segments()
    sender.push([(name, tensor * 3) for name, tensor in changed.items()], version=10)
    kept = our_segments() - before
    assert len(kept) == 2  # two segments, alternating: the third bucket rewrote the first one's after it landed
    metrics = sender.push(list(changed.items()), version=11)
    assert our_segments() - before == kept  # written in place again, no new file
    # 1 MB buckets, and the dtype changes between the tensors: the large one alone, the bfloat16 one alone, the rest
    # (the norm, and the tiny models' MLP tensor) together.
    assert metrics["sync/buckets"] == 3
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in changed.values())
    sender.keep_segments = False  # a GPU sender's: the segments last one push, dropped after `end_weight_update`
    sender.push(list(changed.items()), version=12)
    assert our_segments() == before
    assert mismatches(engine, list(changed), rows=4) == expected_mismatches(engine, list(changed))
    with torch.no_grad():
        for name, tensor in changed.items():
            engine.tensor(name).copy_(tensor.float())
    assert mismatches(engine, list(changed), rows=4) == set()

    async def generate() -> Any:
        async with SGLangClient(engine.url) as client:
            await client.flush_cache()
            return await client.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))

    prompt = chat_ids(engine.model_dir)
    generation = run(generate())
    assert generation.output_ids == hf_greedy(engine.hf, prompt, 4) and generation.weight_version == "12"


def test_whole_model_in_one_bucket_reads_back(engine: Engine) -> None:
    # Every tensor of the checkpoint (SmolLM2's tied embeddings: no lm_head; the MoE's experts one by one), 600 MB
    # buckets: one bucket of the model (SmolLM2: 540 MB).
    state = list(engine.state().items())
    sender = TensorSender(SyncConfig(bucket_mb=600), [engine.endpoint()], f"whole_{free_port()}")
    sender.connect()
    before = our_segments()
    try:
        metrics = sender.push(state, version=12)
        assert len(our_segments() - before) == 1 and metrics["sync/buckets"] == 1
    finally:
        sender.close()
    assert our_segments() == before  # closing the sender removed its file
    last = f"model.layers.{engine.hf.config.num_hidden_layers - 1}."
    names = ["model.embed_tokens.weight", *(n for n in sorted(engine.names) if n.startswith(last)), "model.norm.weight"]
    assert mismatches(engine, names, rows=3) == set()


def test_unknown_name_fails_before_anything_is_sent(engine: Engine, sender: TensorSender) -> None:
    # SGLang 0.5.23 accepts an unknown name on this path too: success, nothing loaded.
    async def version() -> str:
        async with SGLangClient(engine.url) as client:
            return str((await client.get_model_info())["weight_version"])

    before = run(version())
    hidden = engine.hf.config.hidden_size
    with pytest.raises(UnknownWeightNameError, match=r"has no weight named 'decoder\.final_layernorm\.weight'"):
        sender.push([("decoder.final_layernorm.weight", torch.ones(hidden))], version=99)
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
    # What verl and slime send: SGLang's own FlattenedTensorBucket and metadata class (resolved to a stand-in), read
    # by the bounded pickle reader an embedded server runs only with --accept-pickle-payloads.
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    writer = subprocess.Popen(
        [str(SGLANG_VENV_PYTHON), "-c", SGLANG_WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        payload = writer.stdout.readline().strip()
        (a, ta), (b, tb) = decode_payload([payload], "flattened_bucket", accept_pickle=True)
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
