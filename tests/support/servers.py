"""Helpers for tests that run real engine servers on 127.0.0.1, and a trainer-side weight push over gloo."""

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import torch
import torch.distributed as dist

from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.ports import free_port
from userrl_megatron.wire.bucket import dtype_name, pack_bucket
from userrl_megatron.wire.group import destroy_custom_process_group, init_custom_process_group

CALL_S = 300.0  # one raw call: a bound for a hung server only


def http_call(
    url: str, path: str, body: Any = None, method: str = "POST", authorization: str | None = None
) -> tuple[int, Any]:
    """A raw HTTP call (urllib: independent of our client); returns (status, JSON or text). `body`: bytes as they
    are, anything else as JSON, None for no body."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=CALL_S) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


async def push_weights(
    client: SGLangClient,
    named_tensors: list[tuple[str, torch.Tensor]],
    group_name: str,
    load_format: str | None = None,
    weight_version: str | None = None,
) -> None:
    """Act as trainer rank 0: create the group with the engine, broadcast the tensors, tear the group down.

    The SGLang sequence: the HTTP calls that block on the collective run in the background while this process
    joins the group / issues its broadcasts.
    """
    port = free_port()
    _, group = await asyncio.gather(
        client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, "gloo"),
        asyncio.to_thread(init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, group_name),
    )
    await client.begin_weight_update()
    await asyncio.gather(
        client.update_weights_from_distributed(
            [name for name, _ in named_tensors],
            [dtype_name(t.dtype) for _, t in named_tensors],
            [list(t.shape) for _, t in named_tensors],
            group_name,
            weight_version=weight_version,
            load_format=load_format,
        ),
        asyncio.to_thread(broadcast_weights, group, named_tensors, load_format),
    )
    await client.end_weight_update()
    await client.destroy_weights_update_group(group_name)
    destroy_custom_process_group(group)


def broadcast_weights(
    group: dist.ProcessGroup, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None
) -> None:
    """Rank 0's side of SGLang's wire protocol: one broadcast per tensor, or one of the flattened bucket."""
    if load_format == "flattened_bucket":
        dist.broadcast(pack_bucket(named_tensors)[0], src=0, group=group)
    else:
        for _, tensor in named_tensors:
            dist.broadcast(tensor.contiguous(), src=0, group=group)
