"""What `userrl train` checks and decides before any process starts (no Ray, no actor, no engine).

- `check_before_start`: the configuration checks once more, now knowing whether the actor ranks get CUDA
  devices (GPU-only features), the run's `checkpoints/latest` (a directory there would fail every save), and
  the checkpoint the run resumes from against the model and TP (vocabulary padding), so that a layout the actor
  ranks would refuse after a minute of start-up fails in seconds.
- `finished_step`: a run already at `run.total_steps` (checkpoint saved and logged, HF export written) needs
  nothing started; the caller just reprints its table.
"""

import json
from pathlib import Path

from userrl_megatron.config import ConfigError, RootConfig
from userrl_megatron.config.checks import check_config
from userrl_megatron.config.model_fit import model_shape
from userrl_megatron.convert.arch import padded_vocab_size

# checkpoint_files' layout (LATEST pointer, EXTRA_FILE), read here without importing the megatron package (it
# imports torch), so that a finished run answers without loading torch; tests/unit/test_config_checks.py writes
# checkpoints with checkpoint_files.commit and reads them back through finished_step.
LATEST, EXTRA_FILE = "latest", "extra_state.json"


def run_directory(cfg: RootConfig) -> Path:
    """`<run.output_dir>/<run.name>`."""
    return Path(cfg.run.output_dir) / cfg.run.name


def check_before_start(cfg: RootConfig, on_gpu: bool | None) -> None:
    """Raise ConfigError for every problem the actor ranks or the resume would hit after start-up (`on_gpu` None:
    not known before Ray is up; `trainer.components.start_components` checks the config again then)."""
    problems = []
    try:
        check_config(cfg, on_gpu=on_gpu)
    except ConfigError as e:
        problems += e.problems
    problems += _resume_problems(cfg)
    if problems:
        raise ConfigError(problems)


def finished_step(cfg: RootConfig) -> int | None:
    """The step of the run's latest checkpoint when it is at (or past) `run.total_steps` and its HF export is
    written (when `checkpoint.save_hf`); None when there is training (or exporting) left to do."""
    if cfg.checkpoint.resume != "auto" and not is_sft_checkpoint(cfg.checkpoint.resume):
        return None  # an SFT checkpoint is only the starting point: the run's own checkpoints say where it is
    run_dir = run_directory(cfg)
    step = _checkpoint_step(run_dir / "checkpoints")
    if step is None or step < cfg.run.total_steps:
        return None
    if cfg.checkpoint.save_hf and not (run_dir / "hf" / f"step_{step}" / "config.json").is_file():
        return None
    if step not in _logged_steps(run_dir / "metrics.jsonl"):
        return None  # killed between the checkpoint and its log line: the driver re-logs it
    return step


def is_sft_checkpoint(path: str | Path) -> bool:
    """Whether `path` (a checkpoint, or a folder with a `latest` pointer) was written by `userrl sft`."""
    path = Path(path)
    for ckpt in (path, _latest(path)):
        if ckpt is None:
            continue
        try:
            return json.loads((ckpt / EXTRA_FILE).read_text()).get("kind") == "sft"
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _latest(root: Path) -> Path | None:
    """The folder `root/latest` names when it names one beside it (`checkpoint_files.latest_target`'s rule), else
    None (no pointer; or one pointing outside, which `check_before_start` reports)."""
    name = _read(root / LATEST)
    if not name or name in (".", "..") or Path(name).name != name or (root / name).is_symlink():
        return None
    return root / name


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _logged_steps(path: Path) -> set[int]:
    try:
        with path.open() as f:
            return {json.loads(line)["step"] for line in f if line.strip()}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _checkpoint_step(root: Path) -> int | None:
    latest = _latest(root)
    if latest is None:
        return None
    try:
        return int(json.loads((latest / EXTRA_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no (readable) checkpoint: the driver decides what to do


def _resume_problems(cfg: RootConfig) -> list[str]:
    from userrl_megatron.run import checkpoint_files

    own = run_directory(cfg) / "checkpoints"
    try:
        checkpoint_files.latest_target(own)  # the run's pointer, which every save moves, whatever it resumes from
    except checkpoint_files.CheckpointError as e:
        return [str(e)]
    except OSError:
        pass
    source = cfg.checkpoint.resume
    if source == "disable":
        return []
    path = own if source == "auto" else Path(source)
    shape = model_shape(cfg.model.path)
    try:
        checkpoint_files.latest_target(path)
    except checkpoint_files.CheckpointError as e:
        return [str(e)]  # a pointer outside the run directory
    except OSError:
        pass
    try:
        meta = checkpoint_files.read_metadata(path)
    except (checkpoint_files.CheckpointError, OSError, ValueError):
        return []  # nothing to resume, or a damaged checkpoint: the driver reports it
    tp = cfg.megatron.tensor_model_parallel_size
    if shape is None or "vocab_size" not in shape or "padded_vocab_size" not in meta or tp < 1:
        return []
    padded = padded_vocab_size(shape["vocab_size"], tp)
    if padded == meta["padded_vocab_size"]:
        return []
    return [
        f"megatron.tensor_model_parallel_size = {tp} pads the vocabulary to {padded} rows, but the checkpoint the "
        f"run resumes from ({path}) was saved with {meta['padded_vocab_size']} rows (TP = {meta['layout']['tp']}): "
        "use a TP that pads it the same way, or set checkpoint.resume"
    ]
