"""A hostile client against `userrl serve` (issue 28, items 2 and 3): values the model cannot take, wrong JSON
types, oversized and deeply nested bodies, long prompts, and weight-update group inits that name nothing.

Each case asserts the status and the error text, that requests batched with the hostile one finish as if alone,
that the server still serves, and that its weights are unchanged. The servers are real subprocesses on
127.0.0.1 (tiny random Llama with a ChatML char tokenizer), as in test_server_http.py; the check that
tokenising stays off the event loop runs the same server in-process, where a gate can hold the tokenizer.

Real SGLang 0.5.23 is not run here: it checks none of these sampling values (an out-of-range one fails its
scheduler) and joins a weight-update group on its scheduler with torch's 30-minute timeout, so none of the
control-call cases can pass against it (docs/engine.md, "Limits and validation").
"""

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy
from tests.support.servers import http_call, push_weights
from tests.support.silent_listener import SilentListener
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.server.core import MAX_STALE_JOINS, EngineCore
from userrl_megatron.server.http import serve

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

# Bounds only a hung server reaches: start-up, a clean exit after SIGTERM, one raw HTTP call.
STARTUP_S = 600.0
STOP_S = 120.0  # the servers that hold joins use a 600 s control timeout: exiting within this is not waiting it out
CALL_S = 120.0
CONTROL_TIMEOUT_S = 60.0  # the module server's rollout.embedded.control_timeout_s: its joins and broadcasts end first
MAX_REQUEST_BYTES = 256 * 1024
MAX_PROMPT_CHARS = 2000
PARAM = "model.layers.0.mlp.up_proj.weight"
NORMAL_PROMPTS = [[5, 17, 33, 60, 2, 44], [9, 8, 7], [40, 41, 42, 43, 44], [12, 13]]
NORMAL_TOKENS = 12
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("hostile") / "a", seed=0, tokenizer="char")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vocab(hf: torch.nn.Module) -> int:
    return hf.config.vocab_size


@pytest.fixture(scope="module")
def greedy_out(hf: torch.nn.Module) -> list[list[int]]:
    """Greedy continuations of NORMAL_PROMPTS by transformers (computed once: a shared CPU makes them slow)."""
    return [hf_greedy(hf, p, NORMAL_TOKENS) for p in NORMAL_PROMPTS]


def _cfg(**overrides: Any) -> EmbeddedServerConfig:
    # One torch thread: on a shared, loaded CPU two threads per tiny forward made every case 20x slower.
    return EmbeddedServerConfig(device="cpu", startup_timeout_s=STARTUP_S, threads=1, **overrides)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cfg = _cfg(
        control_timeout_s=CONTROL_TIMEOUT_S, max_request_bytes=MAX_REQUEST_BYTES, max_prompt_chars=MAX_PROMPT_CHARS
    )
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    srv = launch_embedded(str(model_dir), cfg, free_port(), served_model_name="tiny", log_path=log)
    yield srv
    assert srv.stop(timeout_s=STOP_S) == 0, srv.log_tail()


def call(url: str, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    """A raw HTTP call (urllib: independent of our client); returns (status, JSON or text)."""
    return http_call(url, path, body, method)


def weights(url: str) -> list[list[float]]:
    status, rows = call(url, "/get_weights_by_name", {"name": PARAM, "truncate_size": 4})
    assert status == 200, rows
    return rows


def assert_unharmed(url: str, hf: torch.nn.Module, greedy_out: list[list[int]]) -> None:
    """Still serving, with the weights it started with."""
    assert call(url, "/health_generate", method="GET")[0] == 200
    assert torch.equal(torch.tensor(weights(url)), hf.model.layers[0].mlp.up_proj.weight[:4])
    body = {"input_ids": NORMAL_PROMPTS[0], "sampling_params": {"max_new_tokens": NORMAL_TOKENS, "temperature": 0}}
    assert call(url, "/generate", body)[1]["output_ids"] == greedy_out[0]


def message(text: str) -> dict[str, Any]:
    """/generate's handler error body (SGLang's `_create_error_response`)."""
    return {"error": {"message": text}}


def openai_error(text: str, kind: str = "BadRequestError") -> dict[str, Any]:
    """The OpenAI routes' error body (SGLang's `ErrorResponse`)."""
    return {"object": "error", "message": text, "type": kind, "param": None, "code": 400}


def invalid(field: str, text: str) -> dict[str, Any]:
    """A type error, in SGLang's validation-error envelope."""
    return openai_error(f"1 validation error:\n  body.{field}: {text}", kind="Bad Request")


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def hostile_cases(vocab: int) -> list[tuple[str, Any, int, Any]]:
    """(path, body, status, response) of every hostile request; the values are the issue's."""
    greedy = {"max_new_tokens": 4, "temperature": 0}
    ids = [5, 6, 7]
    chat = {"messages": MESSAGES, "max_tokens": 4}
    return [
        # values the model cannot take, on /generate
        (
            "/generate",
            {"input_ids": ids, "sampling_params": greedy, "return_logprob": True, "top_logprobs_num": 1_000_000},
            400,
            message("top_logprobs_num must be in [0, 20] (rollout.embedded.max_top_logprobs_num), got 1000000."),
        ),
        (
            "/generate",
            {"input_ids": ids, "sampling_params": greedy, "return_logprob": True, "top_logprobs_num": -5},
            400,
            message("top_logprobs_num must be in [0, 20] (rollout.embedded.max_top_logprobs_num), got -5."),
        ),
        (
            "/generate",
            {"input_ids": ids, "sampling_params": {**greedy, "logit_bias": {"5": 1e308}}},
            400,
            message("logit_bias values must be in [-100, 100], got 1e+308 for token 5."),
        ),
        (
            "/generate",
            {"input_ids": ids, "sampling_params": {**greedy, "stop_token_ids": [vocab], "min_new_tokens": 2}},
            400,
            message(f"stop_token_ids must be in [0, {vocab - 1}], got [{vocab}]."),
        ),
        (
            "/generate",
            {"input_ids": ids, "sampling_params": {**greedy, "stop_token_ids": [2**70], "min_new_tokens": 2}},
            400,
            message(f"stop_token_ids must be in [0, {vocab - 1}], got [{2**70}]."),
        ),
        # the same through the OpenAI routes
        (
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": 1_000_000},
            400,
            openai_error("top_logprobs must be in [0, 20], got 1000000."),
        ),
        (
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": -5},
            400,
            openai_error("top_logprobs must be in [0, 20], got -5."),
        ),
        (
            "/v1/completions",
            {"prompt": ids, "max_tokens": 4, "logprobs": 1_000_000},
            400,
            openai_error("logprobs must be in [0, 5], got 1000000."),
        ),
        (
            "/v1/chat/completions",
            {**chat, "logit_bias": {"5": 1e308}},
            400,
            openai_error("logit_bias values must be in [-100, 100], got 1e+308 for token 5."),
        ),
        (
            "/v1/chat/completions",
            {**chat, "stop_token_ids": [2**70], "min_tokens": 2},
            400,
            openai_error(f"stop_token_ids must be in [0, {vocab - 1}], got [{2**70}]."),
        ),
        (
            "/v1/completions",
            {"prompt": ids, "max_tokens": 4, "stop_token_ids": [vocab], "min_tokens": 2},
            400,
            openai_error(f"stop_token_ids must be in [0, {vocab - 1}], got [{vocab}]."),
        ),
        # wrong JSON types on the OpenAI routes
        (
            "/v1/chat/completions",
            {**chat, "response_format": "json"},
            400,
            invalid("response_format", "Input should be of type dict, got 'json'"),
        ),
        (
            "/v1/chat/completions",
            {**chat, "max_tokens": [1]},
            400,
            invalid("max_tokens", "Input should be of type int, got [1]"),
        ),
        (
            "/v1/chat/completions",
            {**chat, "temperature": {}},
            400,
            invalid("temperature", "Input should be of type float, got {}"),
        ),
        (
            "/v1/chat/completions",
            {**chat, "logit_bias": [1]},
            400,
            invalid("logit_bias", "Input should be of type dict, got [1]"),
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            400,
            invalid("messages.0.content", "Input should be a string or a list of content parts, got 5"),
        ),
        (
            "/v1/completions",
            {"prompt": [1.5]},
            400,
            invalid(
                "prompt",
                "Input should be a string, a list of strings, a list of token ids or a list of lists of token ids, "
                "got [1.5]",
            ),
        ),
        # deeply nested JSON: past the interpreter's stack, and past the limit but within the stack
        (
            "/v1/chat/completions",
            nested(100_000),
            400,
            openai_error("1 validation error:\n  body: JSON nested deeper than 64 levels", kind="Bad Request"),
        ),
        (
            "/v1/chat/completions",
            nested(65),
            400,
            openai_error("1 validation error:\n  body: JSON nested deeper than 64 levels", kind="Bad Request"),
        ),
        (
            "/generate",
            b'{"input_ids": [1], "sampling_params": {"logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
            400,
            openai_error("1 validation error:\n  body: JSON nested deeper than 64 levels", kind="Bad Request"),
        ),
    ]


CASE_IDS = [
    "generate-top_logprobs_num-1e6",
    "generate-top_logprobs_num-neg",
    "generate-logit_bias-1e308",
    "generate-stop_token_ids-vocab",
    "generate-stop_token_ids-2**70",
    "chat-top_logprobs-1e6",
    "chat-top_logprobs-neg",
    "completions-logprobs-1e6",
    "chat-logit_bias-1e308",
    "chat-stop_token_ids-2**70",
    "completions-stop_token_ids-vocab",
    "chat-response_format-str",
    "chat-max_tokens-list",
    "chat-temperature-map",
    "chat-logit_bias-list",
    "chat-content-int",
    "completions-prompt-float",
    "chat-nested-100000",
    "chat-nested-65",
    "generate-nested-100000",
]


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_a_hostile_request_is_refused_and_its_batch_finishes(
    server: ServerProcess, hf: torch.nn.Module, greedy_out: list[list[int]], vocab: int, case: int
) -> None:
    """Normal requests wait in the queue (generation paused) when the hostile one arrives, so an accepted hostile
    request would be prefilled with them; at 84e0012 the scheduler then failed the whole batch."""
    path, body, status, expected = hostile_cases(vocab)[case]
    url = server.url

    def waiting() -> int:
        return call(url, "/server_info", method="GET")[1]["internal_states"][0]["waiting"]

    async def scenario() -> tuple[tuple[int, Any], list[dict]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_S)) as session:

            async def post(p: str, b: Any) -> tuple[int, Any]:
                data = b if isinstance(b, bytes) else json.dumps(b).encode()
                async with session.post(url + p, data=data, headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                    try:
                        return r.status, json.loads(raw)
                    except json.JSONDecodeError:
                        return r.status, raw.decode()

            assert (await post("/pause_generation", {"mode": "in_place"}))[0] == 200
            try:
                params = {"max_new_tokens": NORMAL_TOKENS, "temperature": 0}
                normal = [
                    asyncio.ensure_future(post("/generate", {"input_ids": p, "sampling_params": params}))
                    for p in NORMAL_PROMPTS
                ]
                while await asyncio.to_thread(waiting) < len(NORMAL_PROMPTS):
                    await asyncio.sleep(0.01)
                hostile = asyncio.ensure_future(post(path, body))
                while not hostile.done() and await asyncio.to_thread(waiting) == len(NORMAL_PROMPTS):
                    await asyncio.sleep(0.01)  # refused at once, or queued with the others
            finally:
                assert (await post("/continue_generation", {}))[0] == 200
            return await hostile, [out for _, out in await asyncio.gather(*normal)]

    (got_status, got), normal = asyncio.run(scenario())
    assert (got_status, got) == (status, expected)
    for out, tokens in zip(normal, greedy_out, strict=True):
        assert out["output_ids"] == tokens, out["meta_info"]["finish_reason"]
    assert_unharmed(url, hf, greedy_out)


@pytest.mark.parametrize(
    "path, body, expected",
    [
        (
            "/generate",
            {"text": "x" * (MAX_PROMPT_CHARS + 1)},
            message(
                f"The text prompt has {MAX_PROMPT_CHARS + 1} characters, more than this server takes "
                f"({MAX_PROMPT_CHARS}: rollout.embedded.max_prompt_chars)."
            ),
        ),
        (
            "/v1/completions",
            {"prompt": ["hi", "x" * (MAX_PROMPT_CHARS + 1)]},
            openai_error(
                f"The text prompt has {MAX_PROMPT_CHARS + 1} characters, more than this server takes "
                f"({MAX_PROMPT_CHARS}: rollout.embedded.max_prompt_chars)."
            ),
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "x" * 1000}, {"role": "user", "content": "y" * 1001}]},
            openai_error(
                f"The chat prompt has {MAX_PROMPT_CHARS + 1} characters, more than this server takes "
                f"({MAX_PROMPT_CHARS}: rollout.embedded.max_prompt_chars)."
            ),
        ),
    ],
    ids=["generate", "completions", "chat"],
)
def test_a_long_text_prompt_is_refused_before_tokenising(
    server: ServerProcess, hf: torch.nn.Module, greedy_out: list[list[int]], path: str, body: dict, expected: dict
) -> None:
    assert call(server.url, path, body) == (400, expected)
    assert_unharmed(server.url, hf, greedy_out)


def test_a_body_over_the_limit_is_refused(
    server: ServerProcess, hf: torch.nn.Module, greedy_out: list[list[int]]
) -> None:
    body = json.dumps({"text": "x" * MAX_REQUEST_BYTES}).encode()
    assert call(server.url, "/generate", body) == (
        413,
        f"Maximum request body size {MAX_REQUEST_BYTES} exceeded.",
    )
    assert_unharmed(server.url, hf, greedy_out)


@pytest.mark.parametrize(
    "path, body, expected",
    [
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"n": 0}}, message("n must be at least 1, got 0.")),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, openai_error("n must be at least 1, got 0.")),
        ("/v1/completions", {"prompt": [5, 6], "n": 0}, openai_error("n must be at least 1, got 0.")),
        ("/v1/completions", {"prompt": [5, 6], "n": 2**70}, openai_error(f"n must be at most 128, got {2**70}.")),
        (
            "/v1/completions",
            {"prompt": [5, 6], "max_tokens": 0},
            openai_error("max_tokens must be a positive integer, got 0."),
        ),
    ],
    ids=["generate", "chat", "completions", "completions-huge", "completions-max_tokens-0"],
)  # fmt: skip
def test_n_0_is_refused(
    server: ServerProcess, hf: torch.nn.Module, greedy_out: list[list[int]], path: str, body: dict, expected: dict
) -> None:
    """OpenAI refuses n < 1 (SGLang 0.5.23 answers n 0 with one sample: stricter here); SGLang's completions
    validator refuses max_tokens 0."""
    assert call(server.url, path, body) == (400, expected)
    assert_unharmed(server.url, hf, greedy_out)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_0_generates_nothing(server: ServerProcess, hf: torch.nn.Module, field: str) -> None:
    """SGLang 0.5.23 turns chat max_tokens 0 into a prefill-only request: no token, finish reason "length"
    (it reads max_completion_tokens 0 as unset, i.e. the whole context; here it is 0 as well)."""
    status, out = call(server.url, "/v1/chat/completions", {"messages": MESSAGES, field: 0})
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == ""
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0


# ---- control calls ----


def init_body(port: int, group: str) -> dict[str, Any]:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
        "backend": "gloo",
    }


def join_failed(reason: str) -> tuple[int, dict[str, Any]]:
    return 400, {"success": False, "message": f"Failed to initialize custom process group: {reason}."}


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


def test_inits_naming_a_dead_address_neither_jam_nor_block(
    server: ServerProcess, hf: torch.nn.Module, greedy_out: list[list[int]]
) -> None:
    """Six inits naming a port where nothing listens (the issue's case): one is pending at a time, each new one
    answers the one before at once, and the trainer's real init answers the last; the real sync then works. At
    84e0012 each held an executor thread for 30 minutes and later inits hung. (The server's control timeout is
    one only a hang reaches, so no init gives up before the next arrives however slow the machine; giving up is
    `test_an_init_naming_a_dead_address_gives_up_after_the_control_timeout`.)"""
    dead = free_port()
    superseded = join_failed("superseded by a newer init_weights_update_group (group 'hostile')")

    async def scenario() -> list[tuple[int, Any]]:
        timeout = aiohttp.ClientTimeout(total=CALL_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            answers = []
            pending = []
            for _ in range(6):
                pending.append(
                    asyncio.ensure_future(
                        post_json(session, server.url + "/init_weights_update_group", init_body(dead, "hostile"))
                    )
                )
                if len(pending) > 1:  # the newcomer answers the one before it
                    answers.append(await pending[-2])
            async with SGLangClient(server.url) as client:  # a real trainer-side sync of the same weights
                await push_weights(client, list(hf.state_dict().items()), "real", "flattened_bucket", "synced")
            answers.append(await pending[-1])
            return answers

    answers = asyncio.run(scenario())
    assert answers == [superseded] * 5 + [join_failed("superseded by a newer init_weights_update_group (group 'real')")]
    assert call(server.url, "/model_info", method="GET")[1]["weight_version"] == "synced"
    assert_unharmed(server.url, hf, greedy_out)
    call(server.url, "/update_weight_version", {"new_version": "default"})


def test_an_init_naming_a_dead_address_gives_up_after_the_control_timeout(model_dir: Path) -> None:
    """Alone (nothing supersedes it), an init naming a port where nothing listens is answered after
    control_timeout_s (an engine of its own, in-process, with a short one: nothing can answer the init before it)."""
    core = EngineCore(str(model_dir), EmbeddedServerConfig(device="cpu", control_timeout_s=1.0, threads=1))
    dead = free_port()
    try:
        answer = asyncio.run(core.init_weights_update_group("127.0.0.1", dead, 1, 2, "alone", "gloo"))
    finally:
        core.shutdown()
    _, body = join_failed(f"nothing listens at tcp://127.0.0.1:{dead} after 1 s (rollout.embedded.control_timeout_s)")
    assert answer == (False, body["message"])
    assert core.groups == {}


def test_a_new_init_cancels_a_join_stuck_in_the_rendezvous(
    server: ServerProcess, hf: torch.nn.Module, greedy_out: list[list[int]]
) -> None:
    """An init whose rendezvous accepts the connection and never answers (already inside torch's join) is
    answered as soon as the trainer's real init arrives, and the real sync goes through. At 84e0012 the stuck
    one's caller waited 30 minutes."""
    listener = SilentListener()

    async def scenario() -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=CALL_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            stuck = asyncio.ensure_future(
                post_json(session, server.url + "/init_weights_update_group", init_body(listener.port, "stale"))
            )
            while listener.received() < 1:  # torch's store client has connected and spoken
                await asyncio.sleep(0.01)
            async with SGLangClient(server.url) as client:
                await push_weights(client, list(hf.state_dict().items()), "real", "flattened_bucket", "after-stale")
            return await stuck

    try:
        answer = asyncio.run(scenario())
    finally:
        listener.close()
    assert answer == join_failed("superseded by a newer init_weights_update_group (group 'real')")
    assert call(server.url, "/model_info", method="GET")[1]["weight_version"] == "after-stale"
    assert_unharmed(server.url, hf, greedy_out)
    call(server.url, "/update_weight_version", {"new_version": "default"})


def no_join_threads() -> bool:
    """No group join or store relay thread is left in this process."""
    return threads("weights-group-join") == threads("store-relay") == 0


def threads(name: str) -> int:
    """Threads of this process named `name` ("weights-group-join": a join; "store-relay": its store relay)."""
    return sum(t.name == name for t in threading.enumerate())


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait until `predicate()` holds; past CALL_S it never will (a hang is what a failure looks like)."""
    deadline = time.monotonic() + CALL_S
    while not predicate():
        assert time.monotonic() < deadline, f"still not: {what}"
        await asyncio.sleep(0.01)


# Trainer rank 0 in a process of its own (torch registers a group name once per process): joins group argv[2]
# at 127.0.0.1:argv[1] and broadcasts 0, 1, 2, 3.
TRAINER = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from userrl_megatron.wire.group import init_custom_process_group
timeout = timedelta(seconds=float(sys.argv[3]))
group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{sys.argv[1]}", 2, 0, sys.argv[2], timeout)
dist.broadcast(torch.arange(4.0), src=0, group=group)
dist.destroy_process_group(group)
"""


async def join_and_receive(core: EngineCore, group_name: str) -> tuple[tuple[bool, str], list[float]]:
    """The engine's answer to a join of a trainer in another process, and the tensor it then broadcasts."""
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), group_name, str(CALL_S)], cwd=REPO)
    try:
        joined = await core.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, "gloo")
        received = torch.zeros(4)
        if joined[0]:
            await asyncio.to_thread(dist.broadcast, received, 0, core.groups[group_name][0])
            assert await core.destroy_weights_update_group(group_name) == (
                True,
                "Succeeded to destroy custom process group.",
            )
        assert await asyncio.to_thread(trainer.wait, CALL_S) == 0
    finally:
        trainer.kill()
    return joined, received.tolist()


def test_abandoned_joins_end_their_threads_and_a_later_join_succeeds(model_dir: Path) -> None:
    """Issue 57 N14: joins stuck inside torch's rendezvous (a peer that accepts and never answers: torch 2.13's
    TCPStore client waits for its ping reply with no timeout), each superseded as soon as it is stuck, twice the
    bound of MAX_STALE_JOINS over. No init is refused, no more than MAX_STALE_JOINS + 1 join threads are ever
    alive, all of them end, and the trainer's real join under the same group name then succeeds and carries a
    broadcast. Before the fix their threads waited forever, and the fifth init on was refused.

    SGLang 0.5.23 joins on its scheduler thread (sglang/srt/managers/scheduler.py:1846), with torch's default
    30-minute timeout (sglang/srt/model_executor/model_runner_components/weight_updater.py:133, no timeout;
    sglang/srt/utils/common.py:2895), one init at a time (sglang/srt/managers/communicator.py:46): there the
    first stuck join holds the scheduler and every later init for good. Its failure semantics are kept: a
    failed join is answered "Failed to initialize custom process group: <why>." and records nothing, so a
    later join under the same name succeeds (weight_updater.py:133-142)."""
    core = EngineCore(str(model_dir), _cfg(control_timeout_s=600.0))
    listener = SilentListener()
    stuck_joins = 2 * MAX_STALE_JOINS + 1

    async def scenario() -> tuple[list[tuple[bool, str]], int, tuple[tuple[bool, str], list[float]]]:
        answers: list[tuple[bool, str]] = []
        pending: asyncio.Future[tuple[bool, str]] | None = None
        most = 0
        for joins in range(1, stuck_joins + 1):
            stuck = asyncio.ensure_future(core.init_weights_update_group("127.0.0.1", listener.port, 1, 2, "g", "gloo"))
            if pending is not None:
                answers.append(await pending)
            await until(lambda: listener.received() >= joins, "torch's store client reached the silent peer")  # noqa: B023
            most = max(most, threads("weights-group-join"))
            pending = stuck
        assert pending is not None
        real = asyncio.ensure_future(join_and_receive(core, "g"))
        answers.append(await pending)
        return answers, most, await real

    try:
        answers, most, (joined, received) = asyncio.run(scenario())
        asyncio.run(until(no_join_threads, "every join and relay thread ended"))
    finally:
        core.shutdown()
        listener.close()
    superseded = join_failed("superseded by a newer init_weights_update_group (group 'g')")[1]["message"]
    assert answers == [(False, superseded)] * stuck_joins
    assert 1 <= most <= MAX_STALE_JOINS + 1
    assert joined == (True, "Succeeded to initialize custom process group.")
    assert received == [0.0, 1.0, 2.0, 3.0]


def test_a_join_stuck_in_the_rendezvous_ends_its_thread_at_the_control_timeout(model_dir: Path) -> None:
    """Issue 57 N14: alone, a join stuck inside torch's rendezvous (the peer accepts and never answers) is
    answered after control_timeout_s, and its thread ends with it. Before the fix the thread waited forever
    (torch 2.13's TCPStore client has no timeout on its ping) and counted against MAX_STALE_JOINS for good."""
    core = EngineCore(str(model_dir), _cfg(control_timeout_s=10.0))
    listener = SilentListener()

    async def scenario() -> tuple[bool, str]:
        join = asyncio.ensure_future(core.init_weights_update_group("127.0.0.1", listener.port, 1, 2, "g", "gloo"))
        await until(lambda: listener.received() == 1, "torch's store client reached the silent peer")
        return await join

    try:
        answer = asyncio.run(scenario())
        asyncio.run(until(no_join_threads, "the join's threads ended"))
    finally:
        core.shutdown()
        listener.close()
    where = f"tcp://127.0.0.1:{listener.port}"
    _, body = join_failed(f"the rendezvous at {where} is incomplete after 10 s (rollout.embedded.control_timeout_s)")
    assert answer == (False, body["message"])
    assert core.groups == {}


def test_sigterm_stops_the_server_with_joins_pending(model_dir: Path, hf: torch.nn.Module, tmp_path: Path) -> None:
    """A server whose control timeout is 600 s, holding the issue's six inits naming a dead address and then
    six joins stuck inside torch's rendezvous, exits at once on SIGTERM; the pending caller is told why. Each
    stuck join's thread ends when the next supersedes it, so none is refused (issue 57 N14: before, four were
    left in their threads for good and the sixth was refused). At 84e0012 SIGTERM did not stop it (only
    SIGKILL did)."""
    srv = launch_embedded(str(model_dir), _cfg(control_timeout_s=600.0), free_port(), log_path=tmp_path / "s.log")
    listener = SilentListener()
    dead = free_port()
    superseded = join_failed("superseded by a newer init_weights_update_group (group 'g')")

    async def scenario() -> list[Any]:
        timeout = aiohttp.ClientTimeout(total=CALL_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            url = srv.url + "/init_weights_update_group"
            dead_inits = [asyncio.ensure_future(post_json(session, url, init_body(dead, "g"))) for _ in range(6)]
            while sum(p.done() for p in dead_inits) < 5:  # all six arrive: five are answered, one is pending
                await asyncio.sleep(0.01)
            answers = [await p for p in dead_inits if p.done()]
            pending = next(p for p in dead_inits if not p.done())
            for joins in range(1, 7):  # each reaches torch's join (its thread) before the next supersedes it
                stuck = asyncio.ensure_future(post_json(session, url, init_body(listener.port, "g")))
                answers.append(await pending)
                while listener.received() < joins:
                    await asyncio.sleep(0.01)
                pending = stuck
            stop = asyncio.ensure_future(asyncio.to_thread(srv.stop, STOP_S))
            answers.append(await pending)
            answers.append(await stop)
            return answers

    try:
        answers = asyncio.run(scenario())
    finally:
        code = srv.stop(timeout_s=STOP_S)
        listener.close()
    assert answers[:11] == [superseded] * 11
    assert answers[11] == join_failed("the server is shutting down")
    assert answers[12] == 0 and code == 0, srv.log_tail()


# ---- tokenising off the event loop (in-process server) ----


def test_a_long_prompt_is_tokenised_off_the_event_loop(model_dir: Path, hf: torch.nn.Module) -> None:
    """While a 1 MB text prompt is being tokenised (held there by a gate), a small request is served; the gate
    opens only after that. At 84e0012 tokenising ran on the event loop, so the small request waited for the gate
    (which then gave up after its bound and recorded it)."""
    cfg = EmbeddedServerConfig(device="cpu", max_request_bytes=4 * 1024**2, max_prompt_chars=2 * 1024**2, threads=1)
    core = EngineCore(str(model_dir), cfg, served_model_name="tiny")
    big = "x" * 1024**2
    entered, gate, gave_up = threading.Event(), threading.Event(), threading.Event()
    encode = core.model.encode

    def gated_encode(text: str) -> list[int]:
        if text == big:
            entered.set()
            if not gate.wait(timeout=CALL_S):
                gave_up.set()
        return encode(text)

    core.model.encode = gated_encode
    port, stop, loop_ready = free_port(), None, threading.Event()
    holder: dict[str, Any] = {}

    def run_server() -> None:
        async def main() -> None:
            holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
            loop_ready.set()
            await serve(core, "127.0.0.1", port, holder["stop"])

        asyncio.run(main())

    core.start()
    thread = threading.Thread(target=run_server, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert loop_ready.wait(CALL_S)
        deadline = time.monotonic() + CALL_S
        while time.monotonic() < deadline:
            try:
                call(url, "/ready", method="GET")
                break
            except urllib.error.URLError:
                time.sleep(0.05)

        async def scenario() -> tuple[tuple[int, Any], tuple[int, Any], bool]:
            timeout = aiohttp.ClientTimeout(total=2 * CALL_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                slow = asyncio.ensure_future(post_json(session, url + "/generate", {"text": big}))
                assert await asyncio.to_thread(entered.wait, CALL_S)
                small_body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
                small = await post_json(session, url + "/generate", small_body)
                held = not gate.is_set() and not gave_up.is_set()  # served while the big one was still held
                gate.set()
                return small, await slow, held

        small, slow, held_while_served = asyncio.run(scenario())
    finally:
        gate.set()
        stop = holder.get("stop")
        if stop is not None:
            holder["loop"].call_soon_threadsafe(stop.set)
        thread.join(STOP_S)
        core.shutdown()
    assert held_while_served and not gave_up.is_set()
    ids = core.model.encode("hi")
    assert small == (200, small[1]) and small[1]["output_ids"] == hf_greedy(hf, ids, 4)
    assert slow == (
        400,
        message(f"The input ({1024**2} tokens) is longer than the model's context length (512 tokens)."),
    )
