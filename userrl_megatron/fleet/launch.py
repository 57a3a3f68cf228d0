"""Start an engine server as a subprocess and wait until it answers `/health_generate`.

One path for both kinds of engine: `userrl serve` (the embedded server, runs anywhere) and
`python -m sglang.launch_server` (GPU clusters). Only the command line differs.
"""

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.auth import DEFAULT_KEY_ENV, key_handover
from userrl_megatron.fleet.engine import HEALTH_PROBE_S
from userrl_megatron.fleet.engine_env import engine_environment
from userrl_megatron.wire.generation import EngineError

log = logging.getLogger(__name__)

HEALTH_PATH = "/health_generate"  # what slime polls; SGLang answers 200 once a generation went through
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Shared-memory files a server makes under a name of its own (SGLang's load reports: its instance id) and removes
# only on a clean exit: a killed server leaves them, and nothing else ever uses them again.
SERVER_SHM_PREFIXES = ("sglang_loads_",)


@dataclass(frozen=True)
class ProcessLaunch:
    """One server process to start: its command line, what it adds to the launcher's allow-listed environment
    (`fleet/engine_env.py`), and the URL to wait on (empty: it serves no HTTP, as the nodes of a multi-node SGLang
    engine after node rank 0).
    `secrets` are environment variables too (the API key), never logged nor shown (dry runs show `env`)."""

    command: list[str]
    env: dict[str, str]
    url: str
    health_path: str = HEALTH_PATH
    watch: bool = False  # run under `fleet/watchdog.py` (`watched`): stopped when its launcher is gone
    secrets: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass
class ServerProcess:
    """A launched engine server: its process (leader of its own process group), URL and log file."""

    process: subprocess.Popen
    url: str
    log_path: Path
    shm_files: list[Path] = field(default_factory=list)  # its own shared-memory files, removed once it stopped

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the whole process group (SGLang forks schedulers), SIGKILL after `timeout_s`, then remove the
        server's own shared-memory files (left behind when it was killed); returns the code."""
        if self.alive():
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
        code = self.process.wait()
        for path in self.shm_files:
            path.unlink(missing_ok=True)
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def watched(command: list[str], parent_pid: int | None = None) -> list[str]:
    """`command` run under `fleet/watchdog.py`: stopped when `parent_pid` (default: this process) is gone."""
    parent = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-m", "userrl_megatron.fleet.watchdog", str(parent), "--", *command]


def connect_host(host: str, node_ip: str = "127.0.0.1") -> str:
    """The address to reach a server bound to `host` on the node at `node_ip` (a wildcard bind: that IP)."""
    return node_ip if host in WILDCARD_HOSTS else host


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` can be reached from its own node only."""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def launch_server(
    command: list[str],
    url: str,
    timeout_s: float,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    health_path: str = HEALTH_PATH,
    secrets: dict[str, str] | None = None,
) -> ServerProcess:
    """Run `command` (stdout and stderr to `log_path`, `env` and `secrets` added to its environment) and block
    until `url` is healthy.

    Raises EngineError, with the end of the server's log, if the process exits or the deadline passes.
    """
    return run_launch(ProcessLaunch(command, env or {}, url, health_path, secrets=secrets or {}), timeout_s, log_path)


def run_launch(launch: ProcessLaunch, timeout_s: float, log_path: Path | None = None) -> ServerProcess:
    """Start `launch` and, when it has a URL, block until it is healthy (stopping it if it never is)."""
    server = start_process(launch, log_path)
    if not launch.url:
        return server
    try:
        wait_healthy(server, timeout_s, health_path=launch.health_path)
    except BaseException:
        server.stop(timeout_s=10)
        raise
    server.shm_files = group_shm_files(server.process.pid)
    return server


def group_shm_files(pgid: int, prefixes: Sequence[str] = SERVER_SHM_PREFIXES) -> list[Path]:
    """The `/dev/shm` files named `prefixes...` that the processes of group `pgid` hold open or mapped."""
    found: set[Path] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):  # a process that just exited
            if int(entry.joinpath("stat").read_text().rpartition(")")[2].split()[2]) != pgid:
                continue
            paths = [os.readlink(fd) for fd in entry.joinpath("fd").iterdir()]
            paths += [line.split(maxsplit=5)[-1] for line in entry.joinpath("maps").read_text().splitlines()]
            found.update(
                Path(p) for p in paths if p.startswith("/dev/shm/") and Path(p).name.startswith(tuple(prefixes))
            )
    return sorted(found)


def start_process(launch: ProcessLaunch, log_path: Path | None = None) -> ServerProcess:
    """Start `launch.command` in its own process group (stdout and stderr to `log_path`), without waiting, with the
    launcher's allow-listed environment plus the launch's variables and secrets (`engine_env.engine_environment`).
    The group is stopped as one (`ServerProcess.stop`); it stays in the launcher's session: Linux shares the CPU
    between sessions first (autogroups), and a server in a session of its own got 0.2% of a core beside a busy
    process of the launcher's (an engine then did not start within 300 s)."""
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="engine-", suffix=".log")[1])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join([f"{k}={v}" for k, v in launch.env.items()] + [f"{k}=<secret>" for k in launch.secrets])
    log.info("launching %s%s (log: %s)", f"{shown} " if shown else "", " ".join(launch.command), log_path)
    with private_log(log_path) as sink:
        process = subprocess.Popen(
            watched(launch.command) if launch.watch else launch.command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=engine_environment(os.environ, launch.env, launch.secrets),
            process_group=0,
        )
    return ServerProcess(process, launch.url.rstrip("/"), log_path)


def private_log(path: Path) -> BinaryIO:
    """`path` opened for appending, readable by its owner only (0600, also when it existed): a server's log may
    show what its callers sent."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with contextlib.suppress(OSError):  # not ours: it stays as its owner made it
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def wait_healthy(server: ServerProcess, timeout_s: float, poll_s: float = 0.5, health_path: str = HEALTH_PATH) -> None:
    """Poll `GET {url}{health_path}` until 200; fail fast if the process dies."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not server.alive():
            raise EngineError(
                f"engine server exited with code {server.process.returncode} before becoming healthy "
                f"({server.url}); last log lines:\n{server.log_tail()}"
            )
        # A probe may take as long as the server's own health timeout (20 s) to answer on a busy machine.
        if probe(server.url + health_path, timeout_s=max(poll_s, min(HEALTH_PROBE_S, deadline - time.monotonic()))):
            return
        if time.monotonic() >= deadline:
            raise EngineError(
                f"engine server at {server.url} not healthy after {timeout_s:.0f}s; last log lines:\n"
                f"{server.log_tail()}"
            )
        time.sleep(poll_s)


def probe(url: str, timeout_s: float) -> bool:
    """True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def embedded_server_command(
    model_path: str,
    cfg: EmbeddedServerConfig,
    port: int,
    dtype: str = "float32",
    served_model_name: str = "",
    python: str = sys.executable,
    parent_pid: int | None = None,
    api_key_env: str = "",
) -> list[str]:
    """The `userrl serve` command line for one embedded engine; with `parent_pid` it exits when that process
    does (so a crashed launcher leaves no server behind); with `api_key_env` it requires the key that
    environment variable holds."""
    command = [
        python, "-m", "userrl_megatron", "serve",
        "--model", model_path,
        "--dtype", dtype,
        "--host", cfg.host,
        "--port", str(port),
        "--device", cfg.device,
        "--context-length", str(cfg.context_length),
        "--max-running-requests", str(cfg.max_running_requests),
        "--max-prefill-tokens", str(cfg.max_prefill_tokens),
        "--prefix-cache-tokens", str(cfg.prefix_cache_tokens),
        "--random-seed", str(cfg.random_seed),
        "--cpu-linear", cfg.cpu_linear,
        "--health-check-timeout", str(cfg.health_check_timeout_s),
        "--control-timeout", str(cfg.control_timeout_s),
        "--max-request-bytes", str(cfg.max_request_bytes),
        "--max-prompt-chars", str(cfg.max_prompt_chars),
        "--max-generate-request-bytes", str(cfg.max_generate_request_bytes),
        "--max-top-logprobs-num", str(cfg.max_top_logprobs_num),
        "--idle-timeout", str(cfg.idle_timeout_s),
        "--body-timeout", str(cfg.body_timeout_s),
        "--max-connections", str(cfg.max_connections),
    ]  # fmt: skip
    if cfg.threads:
        command += ["--threads", str(cfg.threads)]
    if cfg.enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if cfg.enable_weights_cpu_backup:
        command.append("--enable-weights-cpu-backup")
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    if parent_pid is not None:
        command += ["--parent-pid", str(parent_pid)]
    if api_key_env:
        command += ["--api-key-env", api_key_env]
    for directory in cfg.weight_dirs:
        command += ["--weights-dir", directory]
    if cfg.max_weight_payload_bytes:
        command += ["--max-weight-payload-bytes", str(cfg.max_weight_payload_bytes)]
    if cfg.constrained_json_disable_any_whitespace:
        command.append("--constrained-json-disable-any-whitespace")
    if cfg.constrained_json_max_whitespace_cnt:
        command += ["--constrained-json-max-whitespace-cnt", str(cfg.constrained_json_max_whitespace_cnt)]
    return command


def embedded_launch(
    model_path: str,
    cfg: EmbeddedServerConfig,
    port: int,
    dtype: str = "float32",
    served_model_name: str = "",
    gpus: Sequence[str] = (),
    node_ip: str = "127.0.0.1",
    api_key: str = "",
    api_key_env: str = DEFAULT_KEY_ENV,
) -> ProcessLaunch:
    """What one embedded engine runs: `userrl serve`, stopped with this process, seeing `gpus` only (if given),
    requiring `api_key` (if given), which it gets in the environment variable `api_key_env`."""
    key_env, secrets = key_handover(api_key, api_key_env)
    command = embedded_server_command(
        model_path, cfg, port, dtype, served_model_name, parent_pid=os.getpid(), api_key_env=key_env
    )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}
    return ProcessLaunch(command, env, f"http://{connect_host(cfg.host, node_ip)}:{port}", secrets=secrets)


def launch_embedded(
    model_path: str,
    cfg: EmbeddedServerConfig,
    port: int,
    dtype: str = "float32",
    served_model_name: str = "",
    log_path: Path | None = None,
    gpus: Sequence[str] = (),
    node_ip: str = "127.0.0.1",
    api_key: str = "",
) -> ServerProcess:
    """Start `userrl serve` (requiring `api_key`, if given) and wait for it."""
    launch = embedded_launch(model_path, cfg, port, dtype, served_model_name, gpus, node_ip, api_key)
    return run_launch(launch, cfg.startup_timeout_s, log_path)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
