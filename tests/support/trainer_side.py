"""The trainer side of weight sync for a Hugging Face state dict, shaped like what `Components` drives
(`ActorGroup.connect_engines/push_weights/disconnect_engines/weight_checksums`) but with one process instead of
Megatron ranks, and the pool's control surface over servers that are already running (no Ray). Both use the
project's real `WeightSender` and `SGLangClient`, so the choreography under test is `Components`' own."""

import asyncio
from typing import Any

import torch

from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import EngineEndpoint, WeightSender
from userrl_megatron.sync.tensor_sender import TensorSender


class StateDictActors:
    """`ActorGroup`'s weight-sync methods over `state` (name -> tensor), one pipeline stage."""

    def __init__(self, state: dict[str, torch.Tensor], sync: SyncConfig) -> None:
        self.state, self.sync = state, sync
        self.senders: dict[str, WeightSender] = {}
        self.pushes: list[int] = []  # versions pushed
        self.methods: list[str] = []  # the transport of each sender made

    def connect_engines(self, engines: list[dict[str, Any]], group_prefix: str, method: str) -> list[str]:
        name = f"{group_prefix}_pp0"
        endpoints = [EngineEndpoint(**e) for e in engines]
        if method == "tensor":
            sender: WeightSender = TensorSender(self.sync, endpoints, name)
            sender.connect()
        else:
            sender = WeightSender(self.sync, endpoints, name, "gloo")
            sender.connect("127.0.0.1", free_port())
        self.senders[name] = sender
        self.methods.append(method)
        return [name]

    def push_weights(self, group_names: list[str], version: int) -> dict[str, float]:
        self.pushes.append(version)
        metrics: dict[str, float] = {}
        for name in group_names:
            metrics |= self.senders[name].push(list(self.state.items()), version)
        return metrics

    def disconnect_engines(self, group_names: list[str]) -> None:
        for name in group_names:
            self.senders.pop(name).close()

    def weight_checksums(self, rows: int) -> dict[str, float]:
        return {name: float(t[:rows].double().sum()) for name, t in self.state.items()}

    def offload(self, weights: bool = True) -> None:
        return None  # nothing to move: no Megatron state here

    def onload(self, weights_only: bool = False) -> None:
        return None

    def offloaded(self) -> list[str]:
        return []


class ServerPool:
    """What `Components` uses of `RolloutPool` (clients, urls, model path, pause, resume, flush, repair), over
    running servers that this pool does not own, all started from checkpoint `model_path` (the weight senders check
    pushed names against it): `repair` checks that each answers, and cannot restart one."""

    exhausted = False
    api_key = ""  # the servers were started without one

    def __init__(self, urls: list[str], model_path: str) -> None:
        self.urls = list(urls)
        self.model_path = model_path
        self.clients = [SGLangClient(url) for url in urls]
        self.paused = False

    async def repair(self, timeout_s: float) -> None:
        await asyncio.gather(*(c.get_model_info() for c in self.clients))

    async def pause(self, mode: str = "abort") -> None:
        await asyncio.gather(*(c.pause(mode) for c in self.clients))
        self.paused = True

    async def resume(self) -> None:
        await asyncio.gather(*(c.resume() for c in self.clients))
        self.paused = False

    async def flush_cache(self) -> None:
        await asyncio.gather(*(c.flush_cache() for c in self.clients))

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
