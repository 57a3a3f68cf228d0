"""`userrl serve --model DIR`: the embedded engine server (SGLang native API + OpenAI chat) on CPU or one GPU;
`--backend sglang` starts the real SGLang server instead, through the launch path the rollout pool uses."""

import argparse
import asyncio

DEFAULT_PORT = 30000  # SGLang's own default: clients written for it find the embedded server at the same place


def _serve(args: argparse.Namespace) -> int:
    if args.backend == "sglang":
        return _serve_sglang(args)
    import logging
    import signal
    from dataclasses import replace

    from userrl_megatron.config.schema import EmbeddedServerConfig
    from userrl_megatron.errors import UserError
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.server.core import EngineCore
    from userrl_megatron.server.http import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from userrl_megatron.observability.noise import quiet_third_party

    quiet_third_party(level=args.log_level)
    overrides = {
        "host": args.host,
        "device": args.device,
        "context_length": args.context_length,
        "max_running_requests": args.max_running_requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "prefix_cache_tokens": args.prefix_cache_tokens,
        "random_seed": args.random_seed,
        "threads": args.threads,
        "cpu_linear": args.cpu_linear,
        "enable_return_routed_experts": args.enable_return_routed_experts or None,
        "enable_weights_cpu_backup": args.enable_weights_cpu_backup or None,
        "health_check_timeout_s": args.health_check_timeout,
        "control_timeout_s": args.control_timeout,
        "max_request_bytes": args.max_request_bytes,
        "max_prompt_chars": args.max_prompt_chars,
        "max_generate_request_bytes": args.max_generate_request_bytes,
        "max_top_logprobs_num": args.max_top_logprobs_num,
        "idle_timeout_s": args.idle_timeout,
        "body_timeout_s": args.body_timeout,
        "max_connections": args.max_connections,
        "weight_dirs": args.weights_dir,
        "max_weight_payload_bytes": args.max_weight_payload_bytes,
        "constrained_json_disable_any_whitespace": args.constrained_json_disable_any_whitespace or None,
        "constrained_json_max_whitespace_cnt": args.constrained_json_max_whitespace_cnt,
    }
    cfg = replace(EmbeddedServerConfig(), **{k: v for k, v in overrides.items() if v is not None})
    api_key = _api_key(args, cfg.host)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    path = str(resolve_model(args.model))
    core = EngineCore(
        path,
        cfg,
        args.dtype or "float32",
        args.served_model_name or args.model,
        args.weight_version,
        accept_pickle_payloads=args.accept_pickle_payloads,
    )

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        watch = asyncio.ensure_future(_watch_parent(args.parent_pid, stop)) if args.parent_pid else None
        await serve(core, cfg.host, args.port, stop, api_key)
        if watch is not None:
            watch.cancel()

    core.start()
    try:
        asyncio.run(run())
    except OSError as e:
        raise UserError(f"cannot serve on {cfg.host}:{args.port}: {e}") from e
    finally:
        core.shutdown()
    return 0


def _serve_sglang(args: argparse.Namespace) -> int:
    """Run `python -m sglang.launch_server` (rollout.sglang defaults) until it exits or this process is stopped."""
    import os
    import signal
    from dataclasses import replace

    from userrl_megatron.config.schema import SGLangConfig
    from userrl_megatron.errors import UserError
    from userrl_megatron.fleet.auth import DEFAULT_KEY_ENV
    from userrl_megatron.fleet.sglang import launch_sglang
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.wire.generation import EngineError

    cfg = SGLangConfig()
    overrides = {"host": args.host, "python": args.sglang_python, "max_total_tokens": args.max_total_tokens}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    api_key = _api_key(args, cfg.host)
    want = args.device or "auto"
    device = "cuda" if want.startswith("cuda") or (want == "auto" and _has_cuda()) else "cpu"
    dtype = "auto" if args.dtype is None else args.dtype
    try:
        server = launch_sglang(
            cfg, str(resolve_model(args.model)), 1, args.port, dtype, device=device,
            served_model_name=args.served_model_name, api_key=api_key, api_key_env=args.api_key_env or DEFAULT_KEY_ENV,
        )  # fmt: skip
    except EngineError as e:
        raise UserError(f"SGLang did not start: {e}") from e
    print(f"serving {args.model} with SGLang at {server.url} (log: {server.log_path})", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # pass the stop on; SGLang then shuts its schedulers down
        signal.signal(sig, lambda *_: os.killpg(server.process.pid, signal.SIGTERM))
    code = server.process.wait()
    server.stop()  # whatever of its process group is left
    return 0 if code in (0, 128 + signal.SIGTERM, -signal.SIGTERM) else 1


def _api_key(args: argparse.Namespace, host: str) -> str:
    """The key the server requires: `$<--api-key-env>`; none ("") only on a loopback address."""
    import os

    from userrl_megatron.config.env_names import env_name_problem
    from userrl_megatron.errors import UserError
    from userrl_megatron.fleet.launch import is_loopback

    if args.api_key_env:
        if problem := env_name_problem("--api-key-env", args.api_key_env):
            raise UserError(problem)
        key = os.environ.get(args.api_key_env, "")
        if not key:
            raise UserError(f"--api-key-env {args.api_key_env}: that environment variable is unset or empty")
        return key
    if not is_loopback(host):
        raise UserError(
            f"serving on {host} needs a key (anyone who reaches the server could replace its weights): export one "
            "in an environment variable and pass --api-key-env NAME"
        )
    return ""


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    """Stop serving once process `pid` is gone (a launcher that died cannot stop its server any more)."""
    import os

    while not stop.is_set():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            stop.set()
            return
        except PermissionError:
            pass  # alive, owned by another user
        await asyncio.sleep(1.0)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `serve`; unset options take their defaults from `rollout.embedded` (EmbeddedServerConfig)."""
    p = sub.add_parser("serve", help="run the embedded engine server (SGLang native API + OpenAI chat)")
    p.add_argument("--model", required=True, help="HF model directory or embedded model name")
    p.add_argument("--backend", default="embedded", choices=("embedded", "sglang"), help="which server to run")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default float32 (SGLang: auto)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT}, as SGLang's)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--context-length", type=int, help="longest prompt + output (default: the model's)")
    p.add_argument("--max-running-requests", type=int, help="requests decoded together")
    p.add_argument("--max-prefill-tokens", type=int, help="prompt tokens prefilled per scheduler iteration")
    p.add_argument("--prefix-cache-tokens", type=int, help="KV tokens kept for prefix reuse (0 disables)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, all cores)")
    p.add_argument("--random-seed", type=int, help="seed of sampled requests without sampling_seed")
    p.add_argument(
        "--cpu-linear", choices=("onednn", "torch"), help="what runs float32 linear layers on CPU (default onednn)"
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record MoE routing so /generate can return routed_experts (as SGLang's flag)",
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep the weights across a release of the weights memory (else they are dropped until the next "
        "weight update, as SGLang's flag)",
    )
    p.add_argument(
        "--constrained-json-disable-any-whitespace",
        action="store_true",
        help="json_schema output in compact form: no whitespace but one space after ',' and ':' (as SGLang's flag)",
    )
    p.add_argument(
        "--constrained-json-max-whitespace-cnt",
        type=int,
        help="most whitespace characters in a row in json_schema output (as SGLang's flag; default: unbounded)",
    )
    p.add_argument("--health-check-timeout", type=float, help="seconds /health waits for a forward")
    p.add_argument("--control-timeout", type=float, help="seconds a blocking control call (group join) may take")
    p.add_argument("--max-request-bytes", type=int, help="largest request body; larger ones get 413")
    p.add_argument("--max-prompt-chars", type=int, help="longest text prompt, refused before tokenising")
    p.add_argument(
        "--max-generate-request-bytes", type=int, help="largest /generate or OpenAI body; larger ones get 413"
    )
    p.add_argument("--max-top-logprobs-num", type=int, help="top log-probs per position /generate may ask for")
    p.add_argument("--idle-timeout", type=float, help="seconds a connection may wait without complete headers")
    p.add_argument("--body-timeout", type=float, help="seconds a request body may take to arrive (else 408)")
    p.add_argument("--max-connections", type=int, help="open connections (at most a quarter of the open-file limit)")
    p.add_argument(
        "--api-key-env",
        help="environment variable holding the API key every call but health must send (Authorization: Bearer); "
        "required unless the host is loopback",
    )
    p.add_argument(
        "--weights-dir",
        action="append",
        help="directory /update_weights_from_disk may load from, with what is below it (repeatable; default none: "
        "the endpoint is refused)",
    )
    p.add_argument("--max-weight-payload-bytes", type=int, help="tensors of one update_weights_from_tensor payload")
    p.add_argument(
        "--accept-pickle-payloads",
        action="store_true",
        help="read SGLang's pickle format on update_weights_from_tensor too, through a bounded reader (for the "
        "conformance suite; the project's senders write this server's own format)",
    )
    p.add_argument("--served-model-name", default="", help="name /v1/models reports (default: --model)")
    p.add_argument("--weight-version", default="default", help="starting weight-version label")
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone (set by the launcher)")
    p.add_argument("--sglang-python", help="SGLang's interpreter (default rollout.sglang.python)")
    p.add_argument("--max-total-tokens", type=int, help="SGLang KV-cache size in tokens")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=_serve)
