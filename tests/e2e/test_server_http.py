"""`userrl serve` as a real subprocess on 127.0.0.1 (tiny random Llama with a ChatML tokenizer): the native
SGLang API, OpenAI chat through the real `openai` client, control endpoints, error paths and weight updates
pushed over gloo by this process acting as trainer rank 0."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.engine_ref import hf_greedy, hf_logprobs
from tests.support.payloads import plain_pickle
from tests.support.servers import http_call, push_weights
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.embedded_payload import write_payload
from userrl_megatron.wire.generation import EngineError
from userrl_megatron.wire.group import destroy_custom_process_group, init_custom_process_group

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    return make_tiny_model("llama", root / "a", seed=0, tokenizer="char"), make_tiny_model(
        "llama", root / "b", seed=1, tokenizer="char"
    )


# Bounds only a hung server reaches: start-up, a clean exit after SIGTERM.
STARTUP_S = 600.0
STOP_S = 300.0


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    # The default health timeout (20 s): a healthy server's /health passes however busy the machine is.
    # Disk loads may read the two models' directories (and nothing else).
    cfg = EmbeddedServerConfig(device="cpu", startup_timeout_s=STARTUP_S, weight_dirs=[str(models[0].parent)])
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    srv = launch_embedded(str(models[0]), cfg, free_port(), served_model_name="tiny", log_path=log)
    yield srv
    assert srv.stop(timeout_s=STOP_S) == 0, srv.log_tail()


@pytest.fixture(scope="module")
def hf_a(models: tuple[Path, Path]) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()


def call(server: ServerProcess, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    """A raw HTTP call to `server`; returns (status, JSON or text)."""
    return http_call(server.url, path, body, method)


def test_generate_matches_transformers(server: ServerProcess, hf_a: torch.nn.Module) -> None:
    prompt = [5, 17, 33, 60, 2, 44]
    status, out = call(
        server,
        "/generate",
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0}, "return_logprob": True},
    )
    assert status == 200
    assert out["output_ids"] == hf_greedy(hf_a, prompt, 20)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["weight_version"] == "default" and meta["input_token_logprobs"] == []
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out["output_ids"]
    expected = hf_logprobs(hf_a, prompt, out["output_ids"])
    assert max(abs(lp - e) for (lp, _, _), e in zip(meta["output_token_logprobs"], expected, strict=True)) < 1e-4


def test_batch_n_and_input_logprobs(server: ServerProcess, hf_a: torch.nn.Module) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2}}
    status, out = call(server, "/generate", body)
    assert status == 200 and len(out) == 4
    assert [o["output_ids"] for o in out] == [hf_greedy(hf_a, p, 4) for p in prompts for _ in range(2)]
    body = {
        "input_ids": [5, 6, 7, 8],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1},
    }
    meta = call(server, "/generate", body)[1]["meta_info"]
    with torch.no_grad():
        lp = torch.log_softmax(hf_a(torch.tensor([[5, 6, 7, 8]])).logits[0], -1)
    assert meta["input_token_logprobs"][0] == [None, 5, None]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [5, 6, 7, 8]
    for i, (value, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert abs(value - lp[i - 1, token].item()) < 1e-4


def message(text: str) -> dict:
    return {"error": {"message": text}}


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"sampling_params": {}}, message("Either text, input_ids or input_embeds should be provided.")),
        ({"input_ids": []}, message("input_ids cannot be empty.")),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}},
            {"error": 'invalid type: string "x", expected i64'},
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_k": 0}},
            message("top_k must be -1 (disable) or at least 1, got 0."),
        ),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -1}},
            message("temperature must be a non-negative finite number, got -1.0."),
        ),
        (
            {"input_ids": [[1], [2]], "rid": ["a", "a"]},
            message("Duplicate request IDs detected within the request: ['a']"),
        ),
    ],
)  # fmt: skip
def test_generate_errors(server: ServerProcess, body: dict, expected: dict) -> None:
    assert call(server, "/generate", body) == (400, expected)


def test_unknown_sampling_key_lists_sglangs_fields(server: ServerProcess) -> None:
    status, out = call(server, "/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert status == 400
    assert out["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`, ")


def test_control_errors(server: ServerProcess) -> None:
    status, out = call(server, "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and out["object"] == "error" and out["code"] == 400 and out["type"] == "Bad Request"
    assert "body.master_port: Field required" in out["message"]
    assert call(server, "/generate", b"{not json")[0] == 400
    assert call(server, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}) == (
        400,
        {
            "success": False,
            "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        },
    )
    assert call(server, "/end_weight_update", {}) == (
        400,
        {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"},
    )
    assert call(server, "/destroy_weights_update_group", {"group_name": "nope"}) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )
    assert call(server, "/get_weights_by_name", {"name": "nope"}) == (
        400,
        {"error": {"message": "Get parameter by name failed"}},
    )
    assert call(server, "/pause_generation", {"mode": "sometimes"})[0] == 400
    for path in ("/pause_generation", "/continue_generation", "/release_memory_occupation", "/begin_weight_update"):
        status, out = call(server, path)  # no body: SGLang 0.5.23 requires one
        assert status == 400 and out["message"] == "1 validation error:\n  body: Field required", path


def test_health_info_pause_flush(server: ServerProcess, hf_a: torch.nn.Module) -> None:
    assert call(server, "/health", method="GET")[0] == 200
    status, info = call(server, "/model_info", method="GET")
    assert status == 200 and info["served_model_name"] == "tiny" and info["model_type"] == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"] and info["weight_version"] == "default"
    assert call(server, "/pause_generation", {"mode": "in_place"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    assert call(server, "/ready", method="GET")[0] == 503
    assert call(server, "/continue_generation", {}) == (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    assert call(server, "/health_generate", method="GET")[0] == 200
    status, text = call(server, "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed.\n")
    rows = call(server, "/get_weights_by_name", {"name": "model.layers.0.mlp.up_proj.weight", "truncate_size": 3})[1]
    assert torch.equal(torch.tensor(rows), hf_a.model.layers[0].mlp.up_proj.weight[:3])


def test_health_fails_while_paused(models: tuple[Path, Path], tmp_path: Path) -> None:
    """A paused engine runs no forward, so its health probe fails whatever the health timeout: a server of its own
    with a short one answers 503 quickly (the module's server keeps the default, which a busy machine never hits).
    """
    cfg = EmbeddedServerConfig(device="cpu", health_check_timeout_s=0.5, startup_timeout_s=STARTUP_S)
    srv = launch_embedded(str(models[0]), cfg, free_port(), log_path=tmp_path / "serve.log")
    try:
        assert call(srv, "/pause_generation", {"mode": "in_place"})[0] == 200
        assert call(srv, "/health", method="GET")[0] == 503
    finally:
        code = srv.stop(timeout_s=STOP_S)
    assert code == 0, srv.log_tail()


def test_streaming_abort_and_weight_version(server: ServerProcess, hf_a: torch.nn.Module) -> None:
    prompt = [9, 8, 7]

    def running() -> int:
        return call(server, "/server_info", method="GET")[1]["internal_states"][0]["running"]

    async def scenario() -> tuple[list[dict], dict]:
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            async with session.post(server.url + "/generate", json=body) as response:
                events = [line.decode().strip() async for line in response.content if line.strip()]
            long = {
                "input_ids": prompt,
                "rid": "long-1",
                "sampling_params": {"max_new_tokens": 400, "min_new_tokens": 400},
            }
            while running() != 0:  # the streamed request's row may still be leaving
                await asyncio.sleep(0.01)
            pending = asyncio.ensure_future(session.post(server.url + "/generate", json=long))
            while running() != 1:
                await asyncio.sleep(0.01)
            call(server, "/pause_generation", {"mode": "in_place"})  # freeze it mid-generation, then abort it
            async with session.post(server.url + "/abort_request", json={"rid": "long"}) as response:
                assert response.status == 200 and await response.read() == b""
            response = await pending
            call(server, "/continue_generation", {})
            return events, await response.json()

    events, aborted = asyncio.run(scenario())
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    expected = hf_greedy(hf_a, prompt, 6)
    assert [c["output_ids"] for c in chunks] == [expected[: i + 1] for i in range(5)] + [expected]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 5
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    reason = aborted["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert 0 < len(aborted["output_ids"]) < 400
    assert call(server, "/update_weight_version", {"new_version": "v7"}) == (
        200,
        {"success": True, "message": "Weight version updated to v7", "new_version": "v7"},
    )
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    assert call(server, "/generate", body)[1]["meta_info"]["weight_version"] == "v7"
    assert call(server, "/model_info", method="GET")[1]["weight_version"] == "v7"
    call(server, "/update_weight_version", {"new_version": "default"})


def test_memory_release_and_resume(server: ServerProcess, models: tuple[Path, Path]) -> None:
    """Released weights come back empty, as from SGLang's memory saver without a host copy: generation is refused
    until a weight update or a disk load has written them again."""
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    before = call(server, "/generate", body)[1]["output_ids"]
    assert call(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}) == (200, None)
    assert call(server, "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
    assert call(server, "/release_memory_occupation", {"tags": ["weights"]}) == (
        400,
        {
            "error": {
                "message": "memory tags ['weights'] are already released; resume them before releasing them again "
                "(SGLang 0.5.23 does not support releasing a tag twice)"
            }
        },
    )
    assert call(server, "/resume_memory_occupation", {}) == (
        400,
        {
            "error": {
                "message": "memory tags ['cuda_graph'] are not released; resume only released tags (SGLang 0.5.23's "
                "scheduler dies with a KeyError on this call)"
            }
        },
    )
    assert call(server, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]}) == (200, None)
    status, refused = call(server, "/generate", body)
    assert status == 400 and refused["error"]["message"].startswith(
        "Cannot generate: the weights were released without a host copy and "
    )
    assert call(server, "/begin_weight_update", {})[0] == 200
    assert call(server, "/update_weights_from_disk", {"model_path": str(models[0])})[1]["success"] is True
    assert call(server, "/end_weight_update", {})[0] == 200
    assert call(server, "/generate", body)[1]["output_ids"] == before


def test_openai_chat_with_the_real_client(server: ServerProcess, models: tuple[Path, Path], hf_a: torch.nn.Module):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True)
    tok = AutoTokenizer.from_pretrained(models[0])
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    expected = hf_greedy(hf_a, ids, 12)
    assert reply.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected)
    assert [c.token for c in reply.choices[0].logprobs.content] == [tok.decode([t]) for t in expected]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_weight_updates_over_gloo_both_formats(server: ServerProcess, models: tuple[Path, Path], hf_a) -> None:
    hf_b = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).eval()
    prompt = [7, 8, 9, 10]

    async def scenario() -> list[Any]:
        async with SGLangClient(server.url) as client:
            greedy = SamplingParams(max_new_tokens=16, temperature=0)
            outs = [await client.generate(prompt, greedy)]
            await push_weights(client, list(hf_b.state_dict().items()), "g-null", None, "b")
            outs.append(await client.generate(prompt, greedy))
            await push_weights(client, list(hf_a.state_dict().items()), "g-flat", "flattened_bucket", "a2")
            outs.append(await client.generate(prompt, greedy))
            await client.begin_weight_update()
            with pytest.raises(EngineError, match="Please call `init_weights_update_group` first"):
                await client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[99, 64]], "gone")
            port = free_port()
            _, group = await asyncio.gather(  # a group that exists, and an update it cannot receive: SGLang's message
                client.init_weights_update_group("127.0.0.1", port, 1, 2, "g-bad", "gloo"),
                asyncio.to_thread(init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, "g-bad"),
            )
            refused = r"^/update_weights_from_distributed: Failed to update parameter online: unsupported load_format "
            with pytest.raises(EngineError, match=refused + r"'safetensors'.* are partially updated\."):
                await client.update_weights_from_distributed(
                    ["model.norm.weight"], ["float32"], [[64]], "g-bad", load_format="safetensors"
                )
            await client.destroy_weights_update_group("g-bad")
            destroy_custom_process_group(group)
            await client.end_weight_update()
            return outs

    before, after_b, after_a = asyncio.run(scenario())
    assert before.output_ids == hf_greedy(hf_a, prompt, 16) and before.weight_version == "default"
    assert after_b.output_ids == hf_greedy(hf_b, prompt, 16) and after_b.weight_version == "b"
    assert after_a.output_ids == before.output_ids and after_a.weight_version == "a2"
    assert (
        max(
            abs(x - y)
            for x, y in zip(after_b.output_logprobs, hf_logprobs(hf_b, prompt, after_b.output_ids), strict=True)
        )
        < 1e-4
    )


def test_server_exits_when_its_launcher_dies(models: tuple[Path, Path]) -> None:
    port = free_port()
    code = (
        "import os\n"
        "from userrl_megatron.config.schema import EmbeddedServerConfig\n"
        "from userrl_megatron.fleet.launch import launch_embedded\n"
        f"cfg = EmbeddedServerConfig(device='cpu', startup_timeout_s={STARTUP_S})\n"
        f"server = launch_embedded({str(models[0])!r}, cfg, {port})\n"
        "print(server.process.pid, flush=True)\n"
        "os._exit(0)\n"  # die without stopping the server
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=STARTUP_S, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + STOP_S  # it notices within a second, then shuts down: only a hang takes longer
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the orphaned server kept running")


def test_load_completions_and_weight_updates_from_tensor_and_disk(
    server: ServerProcess, models: tuple[Path, Path], hf_a: torch.nn.Module
) -> None:
    import base64

    assert call(server, "/get_load", method="GET") == (
        200,
        [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}],
    )
    status, out = call(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True},
    )
    assert status == 200 and out["object"] == "text_completion"
    assert out["choices"][0]["token_ids"] == hf_greedy(hf_a, [5, 6, 7], 4)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    assert call(server, "/v1/completions", {"prompt": [1], "max_tokens": 0})[1]["message"] == (
        "max_tokens must be a positive integer, got 0."
    )

    norm = hf_a.model.norm.weight.detach()
    payload = write_payload([("model.norm.weight", norm * 2)], inline=True)  # the embedded engine's own format
    body = {"serialized_named_tensors": [payload], "weight_version": "t1"}
    assert call(server, "/update_weights_from_tensor", body) == (
        400,
        {
            "success": False,
            "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
        },
    )
    assert call(server, "/begin_weight_update", {})[0] == 200
    status, out = call(server, "/update_weights_from_tensor", body)
    assert (status, out) == (200, {"success": True, "message": "Success Weight version updated to t1."}), out
    # Where real SGLang 0.5.23's server dies (its scheduler raises), the embedded one refuses and lives on; it reads
    # no pickle unless started with --accept-pickle-payloads (tests/e2e/test_hostile_payloads.py).
    bad = {
        "wrong shape": (
            write_payload([("model.norm.weight", torch.ones(3))], inline=True),
            None,
            r"norm.weight: shape \(3,\) does not match",
        ),
        "unknown format": (
            write_payload([("model.norm.weight", norm)], inline=True),
            "safetensors",
            "Unknown load_format=safetensors",
        ),
        "a pickle": (
            base64.b64encode(plain_pickle(os.getcwd)).decode(),
            None,
            r"the payload is a pickle \(SGLang's format\), which this server reads only when started with "
            "--accept-pickle-payloads",
        ),
    }
    for what, (payload, load_format, message) in bad.items():
        status, out = call(server, "/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                                    "load_format": load_format})  # fmt: skip
        assert status == 400 and re.search(message, out["message"]), (what, out)
    status, out = call(server, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert status == 400 and "no payload for TP rank 0 (0 given)" in out["message"]
    status, out = call(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%"]})
    assert status == 400 and out["object"] == "error" and "Expected base64-encoded bytes" in out["message"]
    assert call(server, "/end_weight_update", {})[0] == 200
    rows = call(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})[1]
    assert torch.equal(torch.tensor(rows), (norm * 2)[:4])

    hf_b = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).eval()
    assert call(server, "/begin_weight_update", {})[0] == 200  # disk loads need the session too
    status, out = call(server, "/update_weights_from_disk", {"model_path": str(models[1]), "weight_version": "b"})
    assert (status, out["success"], out["num_paused_requests"]) == (200, True, 0)
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    assert call(server, "/generate", body)[1]["output_ids"] == hf_greedy(hf_b, [7, 8, 9], 6)
    status, out = call(server, "/update_weights_from_disk", {"model_path": str(models[0].parent / "nonexistent")})
    assert status == 400 and out["message"].startswith("Failed to get weights iterator: no *.safetensors files")
    restore = {"model_path": str(models[0]), "weight_version": "default"}
    assert call(server, "/update_weights_from_disk", restore)[0] == 200
    assert call(server, "/end_weight_update", {})[0] == 200
    assert call(server, "/generate", body)[1]["output_ids"] == hf_greedy(hf_a, [7, 8, 9], 6)
