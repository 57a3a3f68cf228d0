"""The environment an engine server process starts with: the launcher's variables on an allow-list, nothing else.

A server used to inherit the launcher's whole environment (a Ray actor's: the user's shell, the Slurm job's, Ray's
own), and some of it is meant for the trainer and harms a server: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
breaks the memory release of torch_memory_saver (slime removes it before it starts SGLang), and
`CUDA_DEVICE_MAX_CONNECTIONS=1` (slurm/job_env.sh, for Megatron's overlap of TP communication with compute) puts
every kernel of a server on one hardware queue (SGLang 0.5.23 sets 8 itself, srt/entrypoints/engine.py:1921; the
embedded server does not). What passes, and why:

- the process basics: `PATH`, `HOME`, user and shell, locale (`LANG`, `LC_*`), `TZ`, `TMPDIR` (SGLang names its
  IPC sockets with `tempfile`);
- the loader and Python: `LD_LIBRARY_PATH` (a site's CUDA and module system), `PYTHONPATH`, `PYTHONUNBUFFERED`;
- proxies (either case) and a site's CA bundle (`SSL_CERT_FILE`, `SSL_CERT_DIR`, `REQUESTS_CA_BUNDLE`,
  `CURL_CA_BUNDLE`), for a model or kernel a server fetches;
- caches: `HF_*`, `HUGGINGFACE_*`, `TRANSFORMERS_*`, `XDG_CACHE_HOME`, `TRITON_*`, `TORCHINDUCTOR_*`,
  `USERRL_CACHE` (the embedded models);
- the fabric: `NCCL_*`, `GLOO_*`, `TP_SOCKET_IFNAME`, `NVSHMEM_*`, `UCX_*` (interfaces, IB devices, debug);
- CUDA and torch: `CUDA_*` except `CUDA_DEVICE_MAX_CONNECTIONS`, `TORCH_*` (`TORCH_NCCL_*`, `TORCH_CUDA_ARCH_LIST`
  for JIT builds), never `PYTORCH_*` (the allocator settings above);
- the servers' own settings: `SGLANG_*`, `TOKENIZERS_PARALLELISM`.

Everything else is dropped: Ray's (`RAY_*`, `OMP_NUM_THREADS=1` of a one-CPU actor), the trainer's venv
(`VIRTUAL_ENV`: SGLang may run from another), Slurm's, a user's unrelated secrets. The launch's own variables
(`ProcessLaunch.env`: the GPUs it sees, SGLang's CPU settings) and its secrets (the run's API key, in the variable
`rollout.api_key_env` names) come on top. tests/unit/test_engine_env.py holds the exact result for an SGLang and
an embedded engine.
"""

from collections.abc import Mapping

PASSED = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
        "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONUNBUFFERED",
        "http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
        "XDG_CACHE_HOME", "USERRL_CACHE", "TP_SOCKET_IFNAME", "TOKENIZERS_PARALLELISM",
    }
)  # fmt: skip
PASSED_PREFIXES = (
    "LC_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TRITON_", "TORCHINDUCTOR_",
    "NCCL_", "GLOO_", "NVSHMEM_", "UCX_", "CUDA_", "TORCH_", "SGLANG_",
)  # fmt: skip
DROPPED = frozenset({"CUDA_DEVICE_MAX_CONNECTIONS"})  # matches a prefix above, still never passed


def passes(name: str) -> bool:
    """Whether the launcher's variable `name` reaches an engine server."""
    return name not in DROPPED and (name in PASSED or name.startswith(PASSED_PREFIXES))


def engine_environment(
    launcher: Mapping[str, str], additions: Mapping[str, str], secrets: Mapping[str, str]
) -> dict[str, str]:
    """The whole environment of a server process: `launcher`'s variables that pass, then `additions`, then
    `secrets` (both set whatever the launcher had)."""
    return {name: value for name, value in launcher.items() if passes(name)} | dict(additions) | dict(secrets)
