"""What a caller with the key still cannot do to `userrl serve` (a real subprocess with an API key): load weights
from disk outside the directories it was started with, outside a weight-update session, or from a checkpoint
that lacks parameters (unless it asks for a partial load); or hand it a tensor payload whose tensor reaches past
its storage. Each refusal is a 400 with its message, after which the server still serves the same weights."""

import asyncio
import base64
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.server.core import EngineCore
from userrl_megatron.wire.embedded_payload import MAGIC

pytestmark = pytest.mark.distributed

KEY = "guard-test-key-0123456789abcdefghijklmnopqrstuv"
STARTUP_S, STOP_S, CALL_S = 600.0, 300.0, 300.0  # bounds a hung server only reaches
PROMPT = [7, 8, 9]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served model outside the allowed root; inside it another model, a copy of the served one, a
    checkpoint of one tensor and a symlink to the served model's directory."""
    root = tmp_path_factory.mktemp("guards")
    served = make_tiny_model("llama", root / "served" / "a", seed=0, tokenizer="char")
    allowed = root / "allowed"
    other = make_tiny_model("llama", allowed / "b", seed=1, tokenizer="char")
    copy = Path(shutil.copytree(served, allowed / "a"))
    (allowed / "partial").mkdir()
    save_file({"model.norm.weight": torch.zeros(64)}, str(allowed / "partial" / "model.safetensors"))
    (allowed / "link").symlink_to(served, target_is_directory=True)
    return {"served": served, "allowed": allowed, "other": other, "copy": copy, "partial": allowed / "partial"}


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    cfg = EmbeddedServerConfig(device="cpu", startup_timeout_s=STARTUP_S, weight_dirs=[str(dirs["allowed"])])
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    srv = launch_embedded(str(dirs["served"]), cfg, free_port(), log_path=log, api_key=KEY)
    yield srv
    assert srv.stop(timeout_s=STOP_S) == 0, srv.log_tail()


def call(server: ServerProcess, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(request, timeout=CALL_S) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw) if raw else None


def norm(server: ServerProcess) -> list[float]:
    return call(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 64})[1]


def greedy(server: ServerProcess) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    return call(server, "/generate", body)[1]["output_ids"]


def refused(message: str) -> tuple[int, dict]:
    return 400, {"success": False, "message": message, "num_paused_requests": 0}


def test_disk_loads_only_from_named_directories_in_a_session_and_whole(
    server: ServerProcess, dirs: dict[str, Path]
) -> None:
    hf_a = AutoModelForCausalLM.from_pretrained(dirs["served"], dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(dirs["other"], dtype=torch.float32).eval()
    before, expected = norm(server), hf_greedy(hf_a, PROMPT, 6)
    assert greedy(server) == expected
    load = "/update_weights_from_disk"
    assert call(server, load, {"model_path": str(dirs["other"])}) == refused(
        "update_weights_from_disk must run between begin_weight_update() and end_weight_update()"
    )
    assert call(server, "/begin_weight_update", {})[0] == 200
    # Outside the allowed directories, existing or not, through a symlink or `..`: the same answer (no oracle).
    for path in (
        dirs["served"],
        dirs["served"].parent / "missing",
        dirs["allowed"] / "link",
        dirs["other"] / ".." / "..",
    ):
        assert call(server, load, {"model_path": str(path)}) == refused(
            f"Failed to get weights iterator: {str(path)!r} is not in a directory this server loads from "
            "(--weights-dir)."
        ), path
    partial = {"model_path": str(dirs["partial"]), "weight_version": "zeros"}
    assert call(server, load, partial) == refused(
        f"Failed to get weights iterator: {dirs['partial']} lacks 38 of the model's parameters "
        "(model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
        "...); a partial load needs allow_partial: true."
    )
    assert norm(server) == before and greedy(server) == expected
    assert call(server, "/model_info", method="GET")[1]["weight_version"] == "default"
    # Asked for, a partial load goes through; a whole checkpoint in an allowed directory loads.
    assert call(server, load, partial | {"allow_partial": True})[0] == 200
    assert norm(server) == [0.0] * 64
    assert call(server, load, {"model_path": str(dirs["other"]), "weight_version": "b"})[0] == 200
    assert greedy(server) == hf_greedy(hf_b, PROMPT, 6)
    assert call(server, load, {"model_path": str(dirs["copy"]), "weight_version": "default"})[0] == 200
    assert call(server, "/end_weight_update", {})[0] == 200
    assert norm(server) == before and greedy(server) == expected


def test_disk_loads_are_off_unless_directories_are_named(dirs: dict[str, Path]) -> None:
    core = EngineCore(str(dirs["served"]), EmbeddedServerConfig(device="cpu"))
    assert asyncio.run(core.update_weights_from_disk(str(dirs["other"]))) == (
        False,
        "update_weights_from_disk is off on this server: start it with --weights-dir DIR "
        "(rollout.embedded.weight_dirs) to load checkpoints from DIR",
    )


def test_a_tensor_larger_than_its_storage_is_refused(server: ServerProcess) -> None:
    before, expected = norm(server), greedy(server)
    # 1 float read as 64 (252 bytes past it), in the embedded engine's format (pickles: test_sglang_payload.py).
    header = {
        "buffers": [{"kind": "inline", "nbytes": 4}],
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "buffer": 0, "offset": 0}],
    }
    text = json.dumps(header).encode()
    payload = base64.b64encode(MAGIC + len(text).to_bytes(4, "little") + text + bytes(4)).decode()
    assert call(server, "/begin_weight_update", {})[0] == 200
    assert call(server, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]}) == (
        400,
        {
            "success": False,
            "message": "Failed to update parameter online: tensor 'model.norm.weight' of 256 bytes at offset 0 does "
            "not fit its buffer of 4 bytes",
        },
    )
    assert call(server, "/end_weight_update", {})[0] == 200
    assert norm(server) == before and greedy(server) == expected
