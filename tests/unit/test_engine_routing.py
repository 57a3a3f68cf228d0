"""The embedded engine returns the experts its MoE routers chose (SGLang's `return_routed_experts`): exact ids
against transformers' router logits, SGLang's rows (positions start … prompt + output − 2) and base64 int32
format, prefix-cache reuse below the start length, and SGLang's refusals."""

import asyncio
import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.launch import launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.server.core import EngineCore
from userrl_megatron.server.model import EngineModel
from userrl_megatron.server.protocol import generate_response, parse_generate
from userrl_megatron.server.scheduler import Request
from userrl_megatron.wire.generation import EngineError

LAYERS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(MOE_FAMILY, tmp_path_factory.mktemp("routing") / "moe", seed=3)


@pytest.fixture(scope="module")
def hf(moe_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def reference_routing(hf: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, top_k] expert ids: the top-k of transformers' router logits over a full forward."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    # softmax is monotonic and the router takes the top-k of its softmax: the order is that of the logits
    per_layer = [logits.topk(TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).numpy().astype(np.int32)


def decode(meta: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, LAYERS, TOP_K)


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_forward_returns_each_layers_top_k(moe_dir: Path, hf: torch.nn.Module) -> None:
    engine = EngineModel(moe_dir)
    tokens = [3, 17, 99, 4, 250, 8, 8, 61, 2]
    logits, routed = engine.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], None, routing=True)
    assert routed.dtype == torch.int32 and tuple(routed.shape) == (1, len(tokens), LAYERS, TOP_K)
    assert np.array_equal(routed[0].numpy(), reference_routing(hf, tokens))
    assert logits.shape == (1, hf.config.vocab_size)
    assert engine.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], None).shape == logits.shape


def test_http_generate_returns_sglangs_routed_experts(moe_dir: Path, hf: torch.nn.Module, tmp_path: Path) -> None:
    cfg = EmbeddedServerConfig(device="cpu", enable_return_routed_experts=True)
    server = launch_embedded(str(moe_dir), cfg, free_port(), log_path=tmp_path / "serve.log")
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    prompt = [5, 6, 7, 8, 200, 13, 40]
    try:
        code, first = post(server.url, {"input_ids": prompt, "sampling_params": greedy, "return_routed_experts": True})
        assert code == 200
        out = first["output_ids"]
        assert len(out) == 6
        full = reference_routing(hf, prompt + out)
        got = decode(first["meta_info"])
        assert got.shape == (len(prompt) + len(out) - 1, LAYERS, TOP_K)  # every position but the last token
        assert np.array_equal(got, full[:-1])

        # the next turn: the conversation so far plus a user reply; the prefix cache holds the first turn's KV
        turn2 = prompt + out + [9, 10, 11]
        body = {
            "input_ids": turn2,
            "sampling_params": greedy,
            "return_routed_experts": True,
            "routed_experts_start_len": len(prompt) + len(out) - 1,
        }
        code, second = post(server.url, body)
        assert code == 200
        assert second["meta_info"]["cached_tokens"] == len(prompt) + len(out) - 1
        full2 = reference_routing(hf, turn2 + second["output_ids"])
        got2 = decode(second["meta_info"])
        assert got2.shape == (3 + 6, LAYERS, TOP_K)  # from the first turn's last token to the last but one
        assert np.array_equal(got2, full2[len(prompt) + len(out) - 1 : -1])

        code, plain = post(server.url, {"input_ids": prompt, "sampling_params": greedy})
        assert code == 200 and "routed_experts" not in plain["meta_info"]

        code, bad = post(server.url, {**body, "routed_experts_start_len": len(turn2) + 1})
        assert code == 400
        assert bad["error"]["message"] == (
            f"recv_req.routed_experts_start_len={len(turn2) + 1} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(turn2)}. Please use a smaller routed_experts_start_len."
        )
        code, bad = post(server.url, {**body, "routed_experts_start_len": -1})
        assert code == 400 and bad["error"]["message"].startswith("recv_req.routed_experts_start_len=-1 is lower")
        code, bad = post(server.url, {**body, "return_routed_experts": 1})
        assert code == 400 and bad["error"] == "invalid type: integer `1`, expected a boolean"
    finally:
        server.stop()


def test_without_the_server_flag_nothing_is_returned(moe_dir: Path) -> None:
    core = EngineCore(str(moe_dir), EmbeddedServerConfig(device="cpu"))
    core.start()
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}
        items, _ = parse_generate(body, core.model)
        request = Request(items[0].input_ids, _spec(3), return_routed_experts=True)
        done = asyncio.run(core.generate(request))
        assert "routed_experts" not in generate_response(done, items[0], core.model)["meta_info"]  # as SGLang
    finally:
        core.shutdown()


def test_the_flag_needs_a_moe_model(tmp_path: Path) -> None:
    dense = make_tiny_model("qwen3", tmp_path / "dense")
    with pytest.raises(
        ValueError, match="enable_return_routed_experts needs a mixture-of-experts model; qwen3 is dense"
    ):
        EngineCore(str(dense), EmbeddedServerConfig(device="cpu", enable_return_routed_experts=True))


def _spec(max_new_tokens: int) -> Any:
    from userrl_megatron.server.sampling import parse_sampling_params

    return parse_sampling_params({"max_new_tokens": max_new_tokens, "temperature": 0.0}, 256)


def test_clients_decode_the_routing(moe_dir: Path, hf: torch.nn.Module, tmp_path: Path) -> None:
    from userrl_megatron.fleet.engine import SGLangClient
    from userrl_megatron.server.local import LocalEngine
    from userrl_megatron.types import SamplingParams

    prompt, sampling = [5, 6, 7, 8, 200, 13, 40], SamplingParams(max_new_tokens=5, temperature=0.0)
    local = LocalEngine.launch(str(moe_dir), EmbeddedServerConfig(device="cpu", enable_return_routed_experts=True))
    try:
        gen = asyncio.run(local.generate(prompt, sampling, routed_experts_start_len=2))
    finally:
        local.close()
    full = reference_routing(hf, prompt + gen.output_ids)
    assert gen.routed_experts.dtype == np.int32
    assert np.array_equal(gen.routed_experts, full[2:-1].reshape(-1, LAYERS * TOP_K))
    assert asyncio.run(_plain_local(moe_dir, prompt, sampling)).routed_experts is None

    server = launch_embedded(str(moe_dir), EmbeddedServerConfig(device="cpu"), free_port())
    try:

        async def ask() -> None:
            async with SGLangClient(server.url) as client:
                await client.generate(prompt, sampling, routed_experts_start_len=0)

        # The embedded server refuses the field (a 400 naming it); SGLang ignores it, and the client's own
        # "returned no routed_experts" message covers that.
        with pytest.raises(EngineError, match="return_routed_experts: this server records no routing: start it with"):
            asyncio.run(ask())
    finally:
        server.stop()


async def _plain_local(moe_dir: Path, prompt: list[int], sampling: Any) -> Any:
    from userrl_megatron.server.local import LocalEngine

    local = LocalEngine.launch(str(moe_dir), EmbeddedServerConfig(device="cpu"))
    try:
        with pytest.raises(EngineError, match="routed experts need an engine started with enable_return_routed"):
            await local.generate(prompt, sampling, routed_experts_start_len=0)
        return await local.generate(prompt, sampling)
    finally:
        local.close()


def test_episode_accumulates_the_routing_turn_by_turn(tmp_path: Path) -> None:
    from gyms.base import StepResult
    from tests.support.chatty import function_task, make_chatty_model
    from tests.support.scripted import ScriptedGym
    from userrl_megatron.config.schema import RolloutConfig
    from userrl_megatron.rollout.chat import ChatTemplate
    from userrl_megatron.rollout.episode import EpisodeRunner
    from userrl_megatron.server.local import LocalEngine

    model_dir = make_chatty_model(tmp_path / "chatty_moe", eos_scale=1.0, family=MOE_FAMILY, seed=2)
    chat = ChatTemplate.from_pretrained(model_dir, "tags")
    cfg = RolloutConfig(max_turns=3, max_new_tokens_per_turn=40, max_response_tokens=400, temperature=1.0)
    gym = ScriptedGym([StepResult("more", 0.0, False, False, {}) for _ in range(3)])
    runner = EpisodeRunner(cfg, chat, lambda task: gym)
    runner.routing_replay = True
    # a random model rarely says <|im_end|> within 40 tokens: some characters also end a turn
    sampling = runner.sampling()
    sampling.stop_token_ids = sorted({*chat.stop_token_ids, *range(40, 100, 5)})
    sampling.seed = 3  # a seed whose episode runs all three turns (the first draws of seed 2 end it at once)
    task = function_task(0, reply_without_tool_call="action")
    engine = LocalEngine.launch(str(model_dir), EmbeddedServerConfig(device="cpu", enable_return_routed_experts=True))
    try:
        episode = asyncio.run(runner.run(task, engine, sampling=sampling))
    finally:
        engine.close()
    assert episode.finish_reason == "max_turns" and len(episode.turns) == 3
    assert len(episode.routed_experts) == 3  # one chunk per turn
    last = episode.turns[-1].end
    assert episode.routed_length == last - 1  # every position up to the last generated token's predecessor
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = reference_routing(hf_model, episode.token_ids[:last])[:-1].reshape(last - 1, LAYERS * TOP_K)
    assert np.array_equal(np.concatenate(episode.routed_experts), want)

    from userrl_megatron.config.schema import AlgoConfig
    from userrl_megatron.trainer.batch import mini_batches, prepare_batch
    from userrl_megatron.types import EpisodeGroup

    other = replace_episode(episode)
    prepared = prepare_batch([EpisodeGroup("g", task, [episode, other])], AlgoConfig())
    assert prepared is not None and prepared.batch.routed_experts is not None
    assert np.array_equal(prepared.batch.routed_experts[0], want)
    assert prepared.batch.routed_experts[1].shape == (0, 0)  # an episode without recorded routing
    halves = mini_batches(prepared.batch, 2, seed=0)
    assert sorted(len(h.routed_experts[0]) for h in halves) == [0, last - 1]


def replace_episode(episode: Any) -> Any:
    """A copy of `episode` with another reward and no recorded routing."""
    from dataclasses import replace

    turns = [replace(t, reward=1.0) for t in episode.turns]
    return replace(episode, turns=turns, routed_experts=[])
