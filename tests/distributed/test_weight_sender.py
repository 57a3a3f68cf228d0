"""The trainer-side WeightSender against a real embedded engine server: several double-buffered buckets per
push, buffers reused across pushes, large tensors broadcast from their own memory after the export and buckets
in the per-tensor format (or every tensor packed into flattened buckets), and the engine generating exactly with
the pushed weights afterwards."""

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import EARLY_SHARE, EngineEndpoint, WeightSender
from userrl_megatron.types import SamplingParams

pytestmark = pytest.mark.distributed

# The MLP's matrices are 1 MiB in fp32 (DIRECT_MIN_BYTES: broadcast from their own memory), attention's are not.
SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "head_dim": 64}


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _generate(url: str, prompt: list[int], n: int) -> tuple[list[int], str]:
    async def go() -> tuple[list[int], str]:
        async with SGLangClient(url) as client:
            await client.flush_cache()  # the trainer flushes after a sync: cached prefixes hold old-weight KV
            result = await client.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0))
            return result.output_ids, result.weight_version

    return asyncio.run(go())


def _recorded(sender: WeightSender, events: list[tuple[str, str]], formats: list[tuple[str | None, int]]) -> None:
    """Record in `events` when the sender sends a bucket and when it waits for one (each named by its first tensor),
    and in `formats` each bucket's load format and bytes."""
    send, wait = sender._send, sender._wait

    def sending(packer: Any, version: int, previous: Any, clock: Any) -> Any:
        events.append(("send", packer.entries[0][0]))
        formats.append((packer.load_format, packer.nbytes))
        return send(packer, version, previous, clock)

    def waiting(inflight: Any, clock: Any) -> None:
        if inflight is not None:
            events.append(("wait", inflight.names[0]))
        wait(inflight, clock)

    sender._send, sender._wait = sending, waiting  # type: ignore[method-assign]


def _exported(
    state: list[tuple[str, torch.Tensor]], events: list[tuple[str, str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in state:
        events.append(("export", name))
        yield name, tensor


def _full_buckets(sizes: list[int], bucket_bytes: int) -> list[int]:
    """The bytes of each bucket when every bucket is filled until the next tensor would not fit (one dtype)."""
    buckets = [0]
    for size in sizes:
        if buckets[-1] and buckets[-1] + size > bucket_bytes:
            buckets.append(0)
        buckets[-1] += size
    return buckets


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "packed"])
def test_sender_pushes_buckets_and_the_engine_uses_them(tmp_path: Path, direct: bool) -> None:
    a = make_tiny_model("llama", tmp_path / "a", seed=0, tokenizer="char", **SHAPE)
    b = make_tiny_model("llama", tmp_path / "b", seed=1, tokenizer="char", **SHAPE)
    hf_a = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    server = launch_embedded(str(a), EmbeddedServerConfig(device="cpu"), free_port(), log_path=tmp_path / "serve.log")
    prompt, n = [5, 6, 7, 8], 12
    sender = WeightSender(SyncConfig(bucket_mb=1, direct=direct), [EngineEndpoint(server.url)], "test_sync")
    try:
        assert _generate(server.url, prompt, n)[0] == _greedy(hf_a, prompt, n)
        sender.connect("127.0.0.1", free_port())
        state = list(hf_b.state_dict().items())
        events: list[tuple[str, str]] = []
        formats: list[tuple[str | None, int]] = []
        _recorded(sender, events, formats)
        metrics = sender.push(_exported(state, events), version=3)
        # The next bucket is exported while the previous one is on the wire: between a bucket's send and the wait
        # for it, tensors of the next bucket were exported (a sender that waited at once would export none).
        # Sends after the last export (what was left in the bucket, the direct batches) have nothing to overlap.
        sent = [first for kind, first in events if kind == "send"]
        assert len(sent) == metrics["sync/buckets"]
        last_export = max(i for i, (kind, _) in enumerate(events) if kind == "export")
        for first in sent:
            at = events.index(("send", first))
            between = events[at : events.index(("wait", first))]
            assert at > last_export or any(kind == "export" for kind, _ in between), events
        assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for _, t in state)
        mlp = sum(t.numel() * 4 for n, t in state if ".mlp." in n)
        assert metrics["sync/direct_bytes"] == (mlp if direct else 0)
        assert metrics["sync/buckets"] > 2  # 1 MB buckets of a ~5 MB model: the double buffering is exercised
        if direct:
            # Every bucket in the per-tensor format (the engine receives each tensor into its parameter), and the
            # first one sent as soon as it held an eighth of a bucket, the wire being idle (the embedding and q_proj:
            # 363,520 bytes, where a full bucket would take k, v and o too). Later ones depend on the wire's timing.
            assert {load_format for load_format, _ in formats} == {None}
            packed = [t.numel() * t.element_size() for n, t in state if ".mlp." not in n]
            first = next(sum(packed[:i]) for i in range(1, len(packed)) if sum(packed[:i]) * EARLY_SHARE >= 2**20)
            assert formats[0][1] == first == 363_520
        else:  # one flattened bucket each, sent when the next tensor would not fit
            assert {load_format for load_format, _ in formats} == {"flattened_bucket"}
            sizes = [t.numel() * t.element_size() for _, t in state]
            assert [nbytes for _, nbytes in formats] == _full_buckets(sizes, 2**20)
        assert _generate(server.url, prompt, n) == (_greedy(hf_b, prompt, n), "3")
        sender.push(list(hf_a.state_dict().items()), version=4)  # the same buffers again
        assert _generate(server.url, prompt, n) == (_greedy(hf_a, prompt, n), "4")
    finally:
        sender.close()
        server.stop()
