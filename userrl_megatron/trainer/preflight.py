"""What `userrl train` checks and decides before any process starts (no Ray, no actor, no engine, no torch).

- `check_before_start`: the configuration checks once more, now knowing whether the actor ranks get CUDA
  devices (GPU-only features), and the run's checkpoints as the checkpoint manager reads them
  (`CheckpointManager.start_problems`), so that a layout the actor ranks would refuse after a minute of start-up
  fails in seconds.
- `finished_step`: a run already at `run.total_steps` (`CheckpointManager.finished_step`) needs nothing started;
  the caller just reprints its table.
"""

from pathlib import Path

from userrl_megatron.config import ConfigError, RootConfig
from userrl_megatron.config.checks import check_config
from userrl_megatron.config.model_fit import model_shape
from userrl_megatron.convert.arch import padded_vocab_size
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.run.run_dir import RunDir

is_sft_checkpoint = CheckpointManager.is_sft  # the driver's name for it, until it asks the manager itself


def run_directory(cfg: RootConfig) -> Path:
    """`<run.output_dir>/<run.name>`."""
    return RunDir.of(cfg).root


def check_before_start(cfg: RootConfig, on_gpu: bool | None) -> None:
    """Raise ConfigError for every problem the actor ranks or the resume would hit after start-up (`on_gpu` None:
    not known before Ray is up; `trainer.components.start_components` checks the config again then)."""
    problems = []
    try:
        check_config(cfg, on_gpu=on_gpu)
    except ConfigError as e:
        problems += e.problems
    source = cfg.checkpoint.resume
    problems += CheckpointManager.start_problems(RunDir.of(cfg), source, _padded_vocab(cfg), _tp(cfg))
    if problems:
        raise ConfigError(problems)


def finished_step(cfg: RootConfig) -> int | None:
    """The step the run finished at, when it is at `run.total_steps` with everything written; else None."""
    return CheckpointManager.finished_step(RunDir.of(cfg), cfg.checkpoint, cfg.run.total_steps)


def _tp(cfg: RootConfig) -> int:
    return cfg.megatron.tensor_model_parallel_size


def _padded_vocab(cfg: RootConfig) -> int | None:
    """The rows the policy's vocabulary is padded to at this TP; None when the model's shape is not known."""
    if cfg.checkpoint.resume == "disable" or _tp(cfg) < 1:
        return None
    shape = model_shape(cfg.model.path)
    if shape is None or "vocab_size" not in shape:
        return None
    return padded_vocab_size(shape["vocab_size"], _tp(cfg))
