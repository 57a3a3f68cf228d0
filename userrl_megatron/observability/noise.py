"""Third-party output a person does not need: filtered at process start, in the driver and in every Ray worker.

What goes:
- warnings about optional accelerators (Transformer Engine, Apex) on CPU, where their absence is the design
  (and a torch note Megatron's CPU path triggers);
  on GPU they stay, once per process (Ray folds the identical lines of all workers into one);
- Megatron's notes about its own APIs (deprecated GPTModel, experimental MiMo, cuda-graph scopes) and
  Deprecation/FutureWarnings raised inside third-party packages: nothing a user of this project can act on;
- one log line per HTTP request (httpx, httpcore, openai, aiohttp access logs) at the default level: they
  return with `logging.level=DEBUG`.
Everything else is left alone.
"""

import logging
import re
import warnings

# Warnings whose text starts with one of these are dropped everywhere.
ALWAYS_IGNORED = (
    r"full scope is deprecated",
    r"MimoModelConfig is experimental",
    r"GPTModel IS DEPRECATED",
    r"MCore's async save is deprecated",
)
# Dropped on CPU only: on a GPU node a missing Transformer Engine or Apex costs speed, so it is worth a line;
# the .grad note comes from Megatron's gradient buffers under the CPU support (megatron/cpu.py).
ACCELERATOR_MISSING = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"Transformer Engine is not installed",
)
CPU_ONLY = (*ACCELERATOR_MISSING, r"The \.grad attribute of a Tensor that is not a leaf Tensor")
# Packages whose own Deprecation/FutureWarnings are not the user's concern.
THIRD_PARTY_MODULES = r"(megatron|transformer_engine|apex|torch|transformers|ray|wandb|google|pydantic)(\.|$)"
# Loggers that write a line per HTTP request at INFO.
REQUEST_LOGGERS = ("httpx", "httpx2", "httpcore", "openai", "openai._base_client", "aiohttp.access", "urllib3")
# Megatron loggers that log (rather than warn) the notes of ALWAYS_IGNORED.
MEGATRON_LOGGERS = ("megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing.strategies.torch")


_INSTALLED: set[tuple[bool, str]] = set()


class _DropMessages(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_third_party(on_gpu: bool = False, level: str = "INFO") -> None:
    """Install the filters in this process (again: no effect). `level`: the run's logging level; at DEBUG the
    per-request HTTP lines stay."""
    if (on_gpu, level) in _INSTALLED:
        return
    _INSTALLED.add((on_gpu, level))
    ignored = ALWAYS_IGNORED if on_gpu else ALWAYS_IGNORED + CPU_ONLY
    for pattern in ignored:
        warnings.filterwarnings("ignore", message=pattern)
    if on_gpu:
        for pattern in ACCELERATOR_MISSING:
            warnings.filterwarnings("once", message=pattern)
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY_MODULES)
    if logging.getLevelName(level) != logging.DEBUG:
        for name in REQUEST_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    for name in MEGATRON_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(ALWAYS_IGNORED))
