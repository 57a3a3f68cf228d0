"""Structured simulator replies end to end: the gyms' reply schemas sent as response_format to a real SGLang server
(.venv-sglang, xgrammar on CPU) serving SmolLM2-135M-Instruct: every reply fits its schema and the gym's parser
takes it at the first attempt, with `user_sim.structured` on and auto (no fallback: SGLang supports it)."""

import asyncio
from collections.abc import Iterator

import jsonschema
import pytest

from gyms.persuade.prompts import SYSTEM as PERSUADE_SYSTEM
from gyms.persuade.replies import PERSONA, STANCES
from gyms.reply_schema import ReplySchema
from gyms.travel.prompts import SEARCH_JUDGE_SYSTEM
from gyms.travel.replies import SEARCH_JUDGE, VERDICTS
from gyms.turtle.prompts import STORY_SYSTEM
from gyms.turtle.replies import JUDGMENTS, story
from gyms.user_sim import UserSimulator
from userrl_megatron.config.schema import SGLangConfig, UserSimConfig
from userrl_megatron.fleet.launch import ServerProcess
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON, launch_sglang
from userrl_megatron.model_store import resolve_model
from userrl_megatron.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CALLS: list[tuple[str, str, ReplySchema]] = [
    (
        PERSUADE_SYSTEM,
        "Claim: cats are better than dogs.\n\nThe persuader's latest argument:\nDogs save lives.",
        PERSONA,
    ),
    (STORY_SYSTEM, "Player's story: she fell.\n\nRubric statements:\n1. She fell\n2. It was night", story(2)),
    (SEARCH_JUDGE_SYSTEM, "Search request: flights from Paris to Rome on May 3", SEARCH_JUDGE),
]


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    cfg = SGLangConfig(max_total_tokens=16384, startup_timeout_s=1200.0)  # a hang only, on a busy CPU
    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    path = str(resolve_model("smollm2-135m-instruct"))
    server = launch_sglang(cfg, path, 1, free_port(), "float32", log_path=log, device="cpu", served_model_name="sim")
    yield server
    server.stop()


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_structured_replies_parse(sglang: ServerProcess, mode: str) -> None:
    cfg = UserSimConfig(
        base_url=f"{sglang.url}/v1", model="sim", api_key_env="none", max_tokens=256, timeout_s=600, structured=mode
    )
    sim = UserSimulator(cfg)

    async def run() -> list[dict[str, object]]:
        try:
            out = []
            for system, user, schema in CALLS:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
                reply = await sim.chat(messages, json=True, schema=schema)
                assert reply.data is not None
                out.append(reply.data)
            return out
        finally:
            await sim.close()

    persona, grades, verdict = asyncio.run(run())
    for data, (_, _, schema) in zip((persona, grades, verdict), CALLS, strict=True):
        jsonschema.validate(data, schema.schema())
    assert persona["stance"] in STANCES
    assert isinstance(grades["scores"], list) and len(grades["scores"]) == 2
    assert all(entry["score"] in JUDGMENTS for entry in grades["scores"])
    assert verdict["alignment_judgement"] in VERDICTS
    metrics = sim.metrics()
    assert (metrics["structured"], metrics["structured_fallback"], metrics["failures"]) == (1.0, 0.0, 0.0)
    assert metrics["retries"] == 0.0  # every reply parsed at the first attempt
