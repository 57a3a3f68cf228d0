"""Engine launch: the SGLang and `userrl serve` command lines, and the shared wait-for-health failure paths
(the healthy path runs with the embedded server in tests/e2e)."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from userrl_megatron.config.schema import EmbeddedServerConfig, SGLangConfig
from userrl_megatron.cores import core_count, cpu_list, usable_cores
from userrl_megatron.fleet import sglang
from userrl_megatron.fleet.launch import (
    ProcessLaunch,
    embedded_launch,
    embedded_server_command,
    group_shm_files,
    launch_server,
    start_process,
)
from userrl_megatron.fleet.router import router_command
from userrl_megatron.fleet.sglang import (
    KEY_ENTRY,
    NodeSpan,
    resolve_device,
    sglang_command,
    sglang_env,
    sglang_launch,
    sglang_python,
)
from userrl_megatron.wire.generation import EngineError


def test_sglang_command_defaults() -> None:
    assert sglang_command(SGLangConfig(), "/models/qwen3-8b", tp_size=1, port=30000, python="py") == [
        "py", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen3-8b",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--tp-size", "1",
        "--dtype", "auto",
        "--mem-fraction-static", "0.5",
        "--base-gpu-id", "0",
        "--skip-server-warmup",
    ]  # fmt: skip


def test_memory_saver_only_for_an_engine_colocated_on_cuda() -> None:
    """torch_memory_saver is what lets an engine release its memory to the actor: asked for only when the engine
    shares its GPUs with it (item 5 of issue 27: it was on for every CUDA engine)."""
    cfg = SGLangConfig()
    assert "--enable-memory-saver" not in sglang_command(cfg, "/m", 1, 30000, python="py")
    assert sglang_command(cfg, "/m", 1, 30000, python="py", colocated=True)[-1] == "--enable-memory-saver"
    assert "--enable-memory-saver" not in sglang_command(cfg, "/m", 1, 30000, python="py", device="cpu", colocated=True)
    off = SGLangConfig(enable_memory_saver=False)
    assert "--enable-memory-saver" not in sglang_command(off, "/m", 1, 30000, python="py", colocated=True)


def test_the_cuda_graph_pool_is_released_only_as_slime_runs_sglang() -> None:
    """`rollout.sglang.release_cuda_graph`: SGLang 0.5.23 captures its decode graphs in the memory saver's region
    only with `SGLANG_MEMORY_SAVER_CUDA_GRAPH` set (model_executor/runner_backend/full_cuda_graph_backend.py:121-124,
    185-195), and its default prefill graphs (breakable on CUDA, model_executor/cuda_graph_config.py:119-123) then
    refuse to start (runner_backend/breakable_cuda_graph_backend.py:84-95): slime sets the variable, and the prefill
    graphs go (`--disable-prefill-cuda-graph`). Only for an engine colocated on CUDA with the memory saver."""
    cfg = SGLangConfig(release_cuda_graph=True)
    launch = sglang_launch(cfg, "/m", 2, 30000, "bfloat16", "cuda", ["0", "1"], colocated=True)
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "0,1", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    assert launch.command[-2:] == ["--enable-memory-saver", "--disable-prefill-cuda-graph"]
    for unreleased in (
        sglang_launch(SGLangConfig(), "/m", 2, 30000, "bfloat16", "cuda", ["0", "1"], colocated=True),
        sglang_launch(cfg, "/m", 2, 30000, "bfloat16", "cuda", ["0", "1"]),  # not colocated: nothing released
        sglang_launch(SGLangConfig(release_cuda_graph=True, enable_memory_saver=False), "/m", 1, 1, gpus=["0"]),
    ):
        assert unreleased.env == {"CUDA_VISIBLE_DEVICES": unreleased.env["CUDA_VISIBLE_DEVICES"]}
        assert "--disable-prefill-cuda-graph" not in unreleased.command
    on_cpu = sglang_launch(cfg, "/m", 1, 30000, device="cpu", colocated=True)
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in on_cpu.env and "--disable-prefill-cuda-graph" not in on_cpu.command


def test_an_engine_wider_than_a_node_names_its_nodes() -> None:
    """An engine of TP16 on 8-GPU nodes: one process per node, each with --nnodes, its --node-rank and node rank
    0's rendezvous address (item 5 of issue 27)."""
    cfg = SGLangConfig(host="0.0.0.0", mem_fraction_static=0.6)
    span = NodeSpan(nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:41000")
    command = sglang_command(cfg, "/m", 16, 30000, "bfloat16", python="py", colocated=True, span=span)
    assert command == [
        "py", "-m", "sglang.launch_server",
        "--model-path", "/m",
        "--host", "0.0.0.0",
        "--port", "30000",
        "--tp-size", "16",
        "--dtype", "bfloat16",
        "--mem-fraction-static", "0.6",
        "--base-gpu-id", "0",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:41000",
        "--skip-server-warmup",
        "--enable-memory-saver",
    ]  # fmt: skip
    one_node = sglang_command(cfg, "/m", 8, 30000, python="py", span=NodeSpan(1, 0, "10.0.0.1:41000"))
    assert "--nnodes" not in one_node and "--dist-init-addr" not in one_node
    with pytest.raises(ValueError, match=r"^tp_size 12 cannot span 8 nodes as node rank 0$"):
        sglang_command(cfg, "/m", 12, 30000, span=NodeSpan(8, 0, "10.0.0.1:41000"))


def test_an_engine_process_sees_exactly_its_own_gpus() -> None:
    """Engine 1 of TP4 on GPUs 4-7 of its node: its process sees those four GPUs and counts from 0; a later node
    of a multi-node engine serves no HTTP (item 2 of issue 27: the process inherited Ray's one-GPU
    CUDA_VISIBLE_DEVICES and was told --base-gpu-id 4)."""
    cfg = SGLangConfig(python="py")
    launch = sglang_launch(cfg, "/m", 4, 30001, "bfloat16", "cuda", ["4", "5", "6", "7"], base_gpu_id=4)
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert launch.command[launch.command.index("--base-gpu-id") + 1] == "0"
    assert launch.command[launch.command.index("--tp-size") + 1] == "4"
    assert (launch.url, launch.watch) == ("http://127.0.0.1:30001", True)
    wildcard = SGLangConfig(python="py", host="0.0.0.0")
    assert sglang_launch(wildcard, "/m", 1, 30002, gpus=["3"], node_ip="10.0.0.2").url == "http://10.0.0.2:30002"
    span = NodeSpan(2, 1, "10.0.0.1:41000")
    follower = sglang_launch(cfg, "/m", 16, 30000, gpus=[str(g) for g in range(8)], span=span, node_ip="10.0.0.2")
    assert follower.url == "" and follower.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    with pytest.raises(ValueError, match=r"^an engine process of tp_size 4 on one node needs 4 GPUs, got \['0'\]$"):
        sglang_launch(cfg, "/m", 4, 30000, gpus=["0"])
    cpu = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": cpu_list(usable_cores())}
    assert sglang_launch(cfg, "/m", 1, 30000, device="cpu").env == cpu


def test_sglang_command_tp_no_memory_saver_and_extra_args() -> None:
    cfg = SGLangConfig(
        mem_fraction_static=0.72,
        enable_memory_saver=False,
        host="0.0.0.0",
        extra_args=["--enable-weights-cpu-backup", "--context-length", "32768"],
    )
    command = sglang_command(cfg, "/m", tp_size=4, port=30004, dtype="bfloat16", base_gpu_id=4, python="py")
    assert command == [
        "py", "-m", "sglang.launch_server",
        "--model-path", "/m",
        "--host", "0.0.0.0",
        "--port", "30004",
        "--tp-size", "4",
        "--dtype", "bfloat16",
        "--mem-fraction-static", "0.72",
        "--base-gpu-id", "4",
        "--skip-server-warmup",
        "--enable-weights-cpu-backup", "--context-length", "32768",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"^tp_size must be >= 1, got 0$"):
        sglang_command(cfg, "/m", tp_size=0, port=1)


def test_sglang_command_context_length() -> None:
    """`--context-length` only when set (0: SGLang takes the model's own)."""
    assert "--context-length" not in sglang_command(SGLangConfig(), "/m", 1, 30000, python="py")
    command = sglang_command(SGLangConfig(context_length=32768), "/m", 2, 31000, "bfloat16", python="py")
    assert command[command.index("--skip-server-warmup") :] == ["--skip-server-warmup", "--context-length", "32768"]


def test_sglang_command_on_cpu() -> None:
    cfg = SGLangConfig(max_total_tokens=16384, enable_weights_cpu_backup=True)
    command = sglang_command(cfg, "/m", 1, 31000, "float32", python="py", device="cpu")
    assert command == [
        "py", "-m", "sglang.launch_server",
        "--model-path", "/m",
        "--host", "127.0.0.1",
        "--port", "31000",
        "--tp-size", "1",
        "--dtype", "float32",
        "--device", "cpu",
        "--skip-server-warmup",
        "--max-total-tokens", "16384",
        "--enable-weights-cpu-backup",
    ]  # fmt: skip
    bind = cpu_list(usable_cores())
    assert sglang_env("cpu") == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": bind}
    assert sglang_env("cuda") == {}
    assert resolve_device(SGLangConfig(), has_gpu=False) == "cpu"
    assert resolve_device(SGLangConfig(), has_gpu=True) == "cuda"
    with pytest.raises(ValueError, match=r"^rollout\.sglang\.device must be auto, cpu or cuda, got 'tpu'$"):
        resolve_device(SGLangConfig(device="tpu"), has_gpu=False)


def test_sglang_python_prefers_the_config_then_on_cpu_the_project_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The project's `.venv-sglang` is a CPU build (`make sglang`): engines on GPUs never default to it, they run
    from the trainer's interpreter unless `rollout.sglang.python` names another (item 5 of issue 56: a
    `.venv-sglang` left by `make test` was preferred over a GPU SGLang)."""
    venv = tmp_path / "python"
    venv.touch()
    monkeypatch.setattr(sglang, "SGLANG_VENV_PYTHON", venv)
    assert sglang_python(SGLangConfig(python="/opt/sglang/bin/python"), "cuda") == "/opt/sglang/bin/python"
    assert sglang_python(SGLangConfig(), "cpu") == str(venv)
    assert sglang_python(SGLangConfig(), "cuda") == sys.executable
    assert sglang_command(SGLangConfig(), "/m", 1, 1)[0] == sys.executable  # on CUDA unless told otherwise
    assert sglang_command(SGLangConfig(), "/m", 1, 1, device="cpu")[0] == str(venv)
    assert router_command(SGLangConfig(), ["http://e:1"], 2, 3)[0] == str(venv)  # the router needs no GPU
    venv.unlink()
    assert sglang_python(SGLangConfig(), "cpu") == sys.executable


def test_embedded_server_command() -> None:
    cfg = EmbeddedServerConfig(device="cpu", max_running_requests=32, prefix_cache_tokens=0)
    assert embedded_server_command("/m", cfg, 31000, "bfloat16", "policy", python="py", parent_pid=42) == [
        "py", "-m", "userrl_megatron", "serve",
        "--model", "/m",
        "--dtype", "bfloat16",
        "--host", "127.0.0.1",
        "--port", "31000",
        "--device", "cpu",
        "--context-length", "0",
        "--max-running-requests", "32",
        "--max-prefill-tokens", "8192",
        "--prefix-cache-tokens", "0",
        "--random-seed", "0",
        "--cpu-linear", "onednn",
        "--health-check-timeout", "20.0",
        "--control-timeout", "30.0",
        "--max-request-bytes", "67108864",
        "--max-prompt-chars", "1000000",
        "--max-generate-request-bytes", "8388608",
        "--max-top-logprobs-num", "20",
        "--idle-timeout", "60.0",
        "--body-timeout", "60.0",
        "--max-connections", "1024",
        "--served-model-name", "policy",
        "--parent-pid", "42",
    ]  # fmt: skip
    # With a key: the variable that holds it (never the key), the directories disk loads may read, the bound of
    # a tensor payload.
    keyed = replace(cfg, weight_dirs=["/ckpt/a", "/ckpt/b"], max_weight_payload_bytes=1024)
    assert embedded_server_command("/m", keyed, 31000, python="py", api_key_env="KEY_VAR")[-8:] == [
        "--api-key-env", "KEY_VAR",
        "--weights-dir", "/ckpt/a",
        "--weights-dir", "/ckpt/b",
        "--max-weight-payload-bytes", "1024",
    ]  # fmt: skip
    launch = embedded_launch("/m", cfg, 31000, api_key="k" * 43, api_key_env="KEY_VAR")
    assert launch.secrets == {"KEY_VAR": "k" * 43} and launch.env == {} and "k" * 43 not in repr(launch)
    assert launch.command[-2:] == ["--api-key-env", "KEY_VAR"]
    keyed_sglang = sglang_command(SGLangConfig(), "/m", 1, 1, python="py", api_key_env="KEY_VAR")
    assert keyed_sglang[:4] == ["py", str(KEY_ENTRY), "KEY_VAR", "sglang.launch_server"]
    assert keyed_sglang[4:] == sglang_command(SGLangConfig(), "/m", 1, 1, python="py")[3:]


def test_engine_threads_share_the_cores_unless_set() -> None:
    """Ray gives an actor holding one CPU OMP_NUM_THREADS=1, which the engine would inherit: the launch names
    its threads, by default the cores this process may use shared among the engines."""
    from userrl_megatron.config.schema import RolloutConfig
    from userrl_megatron.fleet.pool import engine_threads

    cores = core_count()
    assert engine_threads(RolloutConfig(num_engines=1)) == cores
    assert engine_threads(RolloutConfig(num_engines=2 * cores)) == 1
    # one_step_off: the trainer computes while the engines generate, so they take half the cores.
    assert engine_threads(RolloutConfig(num_engines=1, mode="one_step_off")) == max(1, cores // 2)
    pinned = RolloutConfig(num_engines=1, embedded=EmbeddedServerConfig(threads=3))
    assert engine_threads(pinned) == 3
    command = embedded_server_command("/m", replace(pinned.embedded, threads=engine_threads(pinned)), 1)
    assert command[command.index("--threads") + 1] == "3"


def test_a_server_that_exits_fails_fast_with_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('bad flag --tp-size'); sys.exit(3)"]
    with pytest.raises(EngineError, match=r"exited with code 3 before becoming healthy(.|\n)*bad flag --tp-size"):
        launch_server(command, "http://127.0.0.1:9", timeout_s=600, log_path=tmp_path / "log")


def test_a_server_that_never_answers_is_killed_at_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait runs on a fake clock that moves on only once the server has printed its first line: the deadline
    passes with that line in the log however slowly the server starts (on the real clock a busy machine could
    start the shell after the 5 s had passed, and the error would show an empty log)."""
    from userrl_megatron.fleet import launch

    log = tmp_path / "log"
    now = [0.0]

    def sleep(seconds: float) -> None:
        started = time.monotonic()
        while not (log.is_file() and log.read_text()):
            assert time.monotonic() - started < 60, "the server printed nothing"  # a bound on a hang only
            time.sleep(0.01)
        now[0] += seconds

    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    command = ["sh", "-c", "echo loading; exec sleep 600"]
    with pytest.raises(EngineError, match=r"not healthy after 5s; last log lines:\nloading"):
        launch_server(command, "http://127.0.0.1:9", timeout_s=5, log_path=log)
    assert now[0] == 5.0  # polled every 0.5 s until the deadline, then stopped


def test_watched_command_stops_when_its_launcher_is_gone() -> None:
    import subprocess

    from userrl_megatron.fleet.launch import watched

    launcher = subprocess.Popen(["sleep", "1"])
    server = subprocess.Popen(watched(["sleep", "600"], launcher.pid), process_group=0)
    launcher.wait()  # gone (and reaped)
    assert server.wait(timeout=600) == 128 + 15  # the server got SIGTERM from the watchdog, which reports it
    assert watched(["x"], 7)[1:] == ["-m", "userrl_megatron.fleet.watchdog", "7", "--", "x"]


def test_serve_sglang_reports_a_server_that_does_not_start(tmp_path: Path) -> None:
    import subprocess

    command = [sys.executable, "-m", "userrl_megatron", "serve", "--backend", "sglang", "--model", str(tmp_path)]
    out = subprocess.run([*command, "--sglang-python", "/bin/false"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert out.stderr.startswith("userrl: error: SGLang did not start: engine server exited with code 1 before")


def test_routed_experts_flags() -> None:
    sglang = sglang_command(SGLangConfig(enable_return_routed_experts=True), "/m", 1, 30000, python="py")
    assert "--enable-return-routed-experts" in sglang
    assert "--enable-return-routed-experts" not in sglang_command(SGLangConfig(), "/m", 1, 30000, python="py")
    embedded = embedded_server_command("/m", EmbeddedServerConfig(enable_return_routed_experts=True), 8000)
    assert "--enable-return-routed-experts" in embedded
    assert "--enable-return-routed-experts" not in embedded_server_command("/m", EmbeddedServerConfig(), 8000)


@pytest.mark.parametrize("key", ["plain-key_0", "-starts-with-a-dash", "--looks-like-a-flag"])
def test_key_entry_hands_over_any_key(tmp_path: Path, key: str) -> None:
    """A generated key (URL-safe base64) starts with "-" once in 64: the module still reads it as the key's value,
    never as a flag of its own, and the key never reaches the output."""
    (tmp_path / "takes_key.py").write_text(
        "import argparse, os\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--port')\n"
        "p.add_argument('--api-key')\n"
        "args = p.parse_args()\n"
        "print(args.port, args.api_key == os.environ['EXPECTED'], args.api_key)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KEY_VAR": key, "EXPECTED": key}
    command = [sys.executable, str(KEY_ENTRY), "KEY_VAR", "takes_key", "--port", "7"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "7 True <redacted>\n"), done.stderr


def test_a_server_has_a_process_group_of_its_own_in_the_launchers_session(tmp_path: Path) -> None:
    """Stopped as one group, scheduled as part of the launcher's session (not an autogroup of its own)."""
    server = start_process(ProcessLaunch(["sleep", "600"], {}, "http://127.0.0.1:9"), tmp_path / "server.log")
    try:
        assert os.getpgid(server.process.pid) == server.process.pid != os.getpgid(0)
        assert os.getsid(server.process.pid) == os.getsid(0)
    finally:
        assert server.stop(timeout_s=60) == -15


HOLDER = textwrap.dedent(
    """
    import mmap, os, sys, time
    if os.fork() == 0:  # a child of the server holds the file, as SGLang's scheduler does
        fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        kept = mmap.mmap(fd, 4096)
    time.sleep(600)
    """
)


def test_a_killed_servers_own_shared_memory_files_go_when_it_is_stopped(tmp_path: Path) -> None:
    path = Path(f"/dev/shm/sglang_loads_test{os.getpid()}_0.shm")
    server = start_process(ProcessLaunch([sys.executable, "-c", HOLDER, str(path)], {}, ""), tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 600  # only a hang waits this long
        while not group_shm_files(server.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        server.shm_files = group_shm_files(server.process.pid)  # what `run_launch` records once a server is healthy
        assert server.shm_files == [path] and group_shm_files(os.getpgid(0)) == []
        os.killpg(server.process.pid, signal.SIGKILL)  # a crash: no exit handler of the server runs
        server.process.wait()
        assert path.exists()
        assert server.stop() == -9 and not path.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        path.unlink(missing_ok=True)
