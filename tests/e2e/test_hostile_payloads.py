"""Hostile weight payloads against `userrl serve` (issue 57, rows N1-N4): pickles that grow a tensor's storage with
uninitialised memory through a BUILD step (N1), use a tuple nested a million deep (N2) or a 32-deep tuple DAG
(N3) as a dict key, and storages by value that were inflated from compressed records before any size check, or
that add up past the engine's bound while each stays under it (N4).

The server, a real subprocess on 127.0.0.1 (tiny random Llama), is started with `--accept-pickle-payloads`, so the
pickles reach the bounded reader of SGLang's format (which only the conformance suite needs); without the flag
every pickle is refused before it is read (tests/e2e/test_server_http.py). Each case asserts a 400 naming the
problem, then that the server still serves, with the weights it started with; a well-formed pickle still loads."""

import base64
import collections
import io
import json
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy
from tests.support.payloads import plain_pickle
from tests.support.servers import http_call
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.launch import ServerProcess, embedded_server_command, launch_server
from userrl_megatron.ports import free_port
from userrl_megatron.wire.sglang_payload import serialize

pytestmark = pytest.mark.distributed

STARTUP_S, STOP_S = 600.0, 120.0  # bounds only a hung server reaches
PAYLOAD_LIMIT = 4 << 20  # the server's --max-weight-payload-bytes
ANSWER_S = 60.0  # how long a push may take to be answered (the DAG's hash alone took 50 s before the fix)
AT_ONCE_S = 10.0  # a refusal before anything is hashed, on a loaded 2-core machine
PROMPT = [7, 8, 9]
NORM = "model.norm.weight"


class Reduce:
    """Pickles as `fn(*args)`, then `BUILD` with `state` when given: how a payload calls an allowed global."""

    def __init__(self, fn: object, *args: object, state: object = None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self) -> tuple:
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


class ByValue:
    """Pickles as `torch.storage._load_from_bytes(data)`: a storage by value, in whatever format `data` is."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple:
        return torch.storage._load_from_bytes, (self.data,)  # looked up here: `plain_pickle` names torch's own


def one_element(storage: object) -> Reduce:
    """A tensor of one element at the start of `storage` (a legal view: it fits)."""
    return Reduce(torch._utils._rebuild_tensor_v2, storage, 0, (1,), (1,), False, collections.OrderedDict())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("payloads") / "a", seed=0, tokenizer="char")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One torch thread: on a shared, loaded CPU two threads per tiny forward made every case 20x slower.
    cfg = EmbeddedServerConfig(device="cpu", threads=1, max_weight_payload_bytes=PAYLOAD_LIMIT)
    port = free_port()
    command = embedded_server_command(str(model_dir), cfg, port, served_model_name="tiny")
    command.append("--accept-pickle-payloads")
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    srv = launch_server(command, f"http://127.0.0.1:{port}", STARTUP_S, log)
    yield srv
    assert srv.stop(timeout_s=STOP_S) == 0, srv.log_tail()


def post(url: str, body: Any, timeout_s: float) -> tuple[int, Any]:
    """A raw JSON POST answered within `timeout_s` (urllib raises past it)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def push(server: ServerProcess, payload: str) -> tuple[int, Any]:
    """One `/update_weights_from_tensor` inside its own weight-update session, answered within ANSWER_S."""
    assert http_call(server.url, "/begin_weight_update", {})[0] == 200
    try:
        body = {"serialized_named_tensors": [payload], "flush_cache": False}
        return post(server.url + "/update_weights_from_tensor", body, ANSWER_S)
    finally:
        if server.alive():
            post(server.url + "/end_weight_update", {}, ANSWER_S)


def refused(server: ServerProcess, payload: str, problem: str) -> None:
    status, out = push(server, payload)
    assert server.alive(), server.log_tail()
    assert (status, out["success"]) == (400, False), out
    assert out["message"].startswith("Failed to update parameter online: ") and problem in out["message"], out


def assert_unharmed(server: ServerProcess, hf: torch.nn.Module) -> None:
    """Alive, its norm weights as loaded, its greedy tokens transformers'."""
    assert server.alive(), server.log_tail()
    status, rows = http_call(server.url, "/get_weights_by_name", {"name": NORM, "truncate_size": 64})
    assert status == 200 and torch.equal(torch.tensor(rows), hf.model.norm.weight.detach()), rows
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    assert http_call(server.url, "/generate", body)[1]["output_ids"] == hf_greedy(hf, PROMPT, 6)


def peak_rss(server: ServerProcess) -> int:
    """The server's peak resident memory so far, in bytes (VmHWM)."""
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def test_n1_a_build_step_on_a_tensor_is_refused(server: ServerProcess, hf: torch.nn.Module) -> None:
    # A legal tensor of one float whose BUILD step calls `Tensor.__setstate__` with the norm's shape: `set_` grew
    # the storage with uninitialised heap memory, loaded as the norm (200, and the heap readable by name).
    storage = torch.ones(1).storage()
    hidden = hf.config.hidden_size
    tensor = one_element(storage)
    tensor.state = (storage, 0, torch.Size([hidden]), (1,))
    refused(server, b64(plain_pickle([(NORM, tensor)])), "BUILD on a Tensor is not allowed")
    assert_unharmed(server, hf)


def test_n2_a_dict_key_nested_a_million_deep_is_refused(server: ServerProcess, hf: torch.nn.Module) -> None:
    # {((...(),),): None}, 10^6 tuples deep: the dict insert hashed it recursively and the engine died (SIGSEGV).
    chain = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns."  # EMPTY_DICT EMPTY_TUPLE TUPLE1... NONE SETITEM
    refused(server, b64(chain), "nested deeper than 16")
    assert_unharmed(server, hf)


def test_n3_a_dict_key_that_is_a_tuple_dag_is_refused_at_once(server: ServerProcess, hf: torch.nn.Module) -> None:
    # t0 = (), t(i+1) = (t(i), t(i)) through the memo: 100 bytes, and hashing t32 takes 2^32 steps holding the
    # GIL (the server ignored SIGTERM for minutes).
    dag = bytearray(b"\x80\x04})\x94")  # EMPTY_DICT, EMPTY_TUPLE memoized as 0
    for i in range(32):
        dag += b"h" + bytes([i]) + b"\x86\x94"  # t(i) is on the stack: BINGET i, TUPLE2, memoized as i + 1
    dag += b"Ns."
    started = time.monotonic()
    refused(server, b64(bytes(dag)), "nested deeper than 16")
    assert time.monotonic() - started < AT_ONCE_S
    assert_unharmed(server, hf)


def deflated_storage(floats: int) -> bytes:
    """A float storage of zeros as torch.save writes it (a zip archive), its records recompressed with deflate."""
    saved = io.BytesIO()
    torch.save(torch.zeros(floats).storage(), saved)
    source, out = zipfile.ZipFile(io.BytesIO(saved.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in source.namelist():
            archive.writestr(name, source.read(name))
    return out.getvalue()


def test_n4_storages_by_value_are_never_inflated_and_bounded_in_total(
    server: ServerProcess, hf: torch.nn.Module
) -> None:
    # 300 storages of 4 MiB zeros (each within the server's 4 MiB bound), deflated to 5 KB and sent once (the memo
    # refers to the bytes again): each was inflated before its size check, 1.2 GB from a 20 KB body.
    zipped = deflated_storage(PAYLOAD_LIMIT // 4)
    payload = b64(plain_pickle([(NORM, one_element(ByValue(zipped))) for _ in range(300)]))
    assert len(payload) < 30_000
    before = peak_rss(server)
    status, out = push(server, payload)
    grown = peak_rss(server) - before
    assert (status, grown < 256 << 20) == (400, True), (out, f"peak memory grew by {grown >> 20} MiB")
    assert "a storage by value in a zip archive is refused" in out["message"], out
    # Three storages in torch's own format (what pickling a storage writes), each under the bound, together over.
    storages = [torch.zeros(3 << 18).storage() for _ in range(3)]  # 3 MiB each
    refused(
        server,
        b64(plain_pickle([(NORM, one_element(s)) for s in storages])),
        f"the payload's storages exceed {PAYLOAD_LIMIT} bytes",
    )
    assert_unharmed(server, hf)


def test_a_well_formed_pickle_still_loads_with_the_flag(server: ServerProcess, hf: torch.nn.Module) -> None:
    # What the flag is for: SGLang's format as its senders write it (shared memory by name), read and loaded.
    norm = hf.model.norm.weight.detach()
    for value in (norm * 2, norm.clone()):  # then back to the weights the other cases check
        status, out = push(server, serialize([(NORM, value)]))
        assert (status, out["success"]) == (200, True), out
        rows = http_call(server.url, "/get_weights_by_name", {"name": NORM, "truncate_size": 64})[1]
        assert torch.equal(torch.tensor(rows), value)
    assert_unharmed(server, hf)
