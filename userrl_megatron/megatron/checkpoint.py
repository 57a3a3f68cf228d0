"""Distributed checkpoints of the actor: model, optimizer, LR schedule, RNG, step and the caller's state.

Layout of one checkpoint directory:

    <dir>/                        Megatron dist-checkpoint (torch_dist): model and optimizer, resharded on load
    <dir>/userrl_checkpoint.json  format, optimizer steps, LR-scheduler state, the layout and model it was saved
                                  with, what it contains ("model", "optimizer"), the optimizer format and the
                                  layer spec
    <dir>/extra_state.json        the caller's state (e.g. the data iterator's position), JSON
    <dir>/rng/rank_XXXXX.pt       per-rank RNG states (restored only into the same layout)
    <dir>/hf/                     the HF model's non-weight files (config, tokenizer), for HF export

Saving is atomic: everything is written to `.<name>.incomplete` beside the target, renamed into place, and
only then is `<parent>/latest` moved to point at it (write-then-rename as well). `keep_last` then deletes
the oldest sibling checkpoints of the run's history (`checkpoint_files.prune`); in the background
(`checkpoint_writer.py`) that commit waits until every rank's files are written. Loading accepts a checkpoint
directory or a folder with a `latest` pointer; the model loads under any TP/PP/DP layout whose padded
vocabulary matches (see `convert.arch.padded_vocab_size`), the optimizer state under any layout when saved
"fully_reshardable", under any DP size when "dp_reshardable". The directory must be on a filesystem every
rank sees.
"""

import contextlib
import dataclasses
import json
import logging
import queue
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.transformer.module import MegatronModule
from torch.distributed.checkpoint.api import CheckpointException

from userrl_megatron.convert.arch import Architecture, padded_vocab_size
from userrl_megatron.convert.hf_io import copy_metadata
from userrl_megatron.convert.rules import INPUT_NORM, MLP_NORM
from userrl_megatron.megatron.checkpoint_writer import CheckpointWriter
from userrl_megatron.megatron.parallel import Layout
from userrl_megatron.run.checkpoint_files import (
    EXTRA_FILE,
    FORMAT_VERSION,
    HF_METADATA,
    META_FILE,
    CheckpointError,
    check_compatible,
    commit,
    prune,
    read_metadata,
    resolve,
    write_manifest,
)

if TYPE_CHECKING:
    from userrl_megatron.megatron.actor import MegatronActor

log = logging.getLogger(__name__)

# The norms' sharded keys under the two layer specs: Megatron-core 0.19's local spec already saves the
# Transformer Engine names; other writers (older Megatron, `--transformer-impl local`) may not.
_TE_TO_LOCAL = {
    r.mcore_te.replace("{i}.", ""): r.mcore.replace("{i}.", "") for r in (INPUT_NORM, MLP_NORM) if r.mcore_te
}
NORM_ALIASES = _TE_TO_LOCAL | {local: te for te, local in _TE_TO_LOCAL.items()}


def model_sharded_state_dict(chunks: list[MegatronModule]) -> dict[str, Any]:
    """The sharded state dict of the (unwrapped) model chunks: "model", or "model0".."modelN" with virtual PP.

    Tensor keys are global layer names, so the nesting does not matter when the layout changes."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_state(
    path: str | Path,
    chunks: list[torch.nn.Module],
    metadata: dict[str, Any],
    hf_dir: Path,
    optimizer: Any = None,
    extra_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    pointer: bool = True,
    optimizer_format: str = "fully_reshardable",
    writer: CheckpointWriter | None = None,
    background: bool = False,
) -> Path:
    """Atomically write a checkpoint of `chunks` (unwrapped) and, if given, `optimizer`. Collective.

    `pointer`: move `<parent>/latest` to it (a training run's checkpoints; not a standalone conversion).
    `optimizer_format`: Megatron's "dp_reshardable" (each rank writes and reads its own buffers, no gathering;
    reshards over DP only) or "fully_reshardable" (gathered per parameter; reshards over TP, PP and DP).
    `background`: return once the tensors are staged in host memory; `writer` writes the files on a thread and
    commits the checkpoint when polled (`CheckpointWriter.poll`/`wait`, on every rank)."""
    extra_json = json.dumps(extra_state or {}, indent=2)  # fails here, before writing, if not JSON-able
    path = Path(path).absolute()
    tmp = path.parent / f".{path.name}.incomplete"
    rank = torch.distributed.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()

    def close() -> None:  # every rank, once every rank's files are written
        if rank == 0:
            meta = {"format_version": FORMAT_VERSION, "saved_at": time.time(), **metadata, **contents}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            (tmp / EXTRA_FILE).write_text(extra_json + "\n")
            copy_metadata(hf_dir, tmp / HF_METADATA)
            write_manifest(tmp)
            commit(tmp, path, pointer)
            if keep_last is not None:
                prune(path.parent, keep_last, current=path)
        torch.distributed.barrier()
        log.info("checkpoint %s written", path)

    with _cleaned_up_on_failure(tmp, rank):
        request, contents = _plan(tmp, chunks, optimizer, optimizer_format, rank)
    finalize = [*request.finalize_fns, close]

    def finish() -> None:
        with _cleaned_up_on_failure(tmp, rank):
            for fn in finalize:
                fn()

    (writer or CheckpointWriter(torch.device("cpu"))).run(request._replace(finalize_fns=[finish]), background)
    return path


class CheckpointWriteError(RuntimeError):
    """A checkpoint writer failed on some rank; the message names the first failure (e.g. no space left)."""


@contextlib.contextmanager
def _cleaned_up_on_failure(tmp: Path, rank: int) -> Iterator[None]:
    """On failure remove what was written (useless); the previous checkpoint and `latest` are untouched."""
    try:
        yield
    except BaseException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointException):  # torch's: a BaseException holding each failed rank's error
            raise CheckpointWriteError(_first_failure(e)) from None
        raise


def _first_failure(error: CheckpointException) -> str:
    rank, (inner, _trace) = next(iter(error.failures.items()))
    lines = str(inner).strip().splitlines()
    return f"rank {rank}: {type(inner).__name__}: {lines[0] if lines else ''}"


def _write_results_in_process() -> None:
    """Megatron's file writer returns its results through a queue that it creates on first use from a
    `multiprocessing.Manager()`, meant for a forked writer process: a spawned server process on every rank (torch
    imported: hundreds of MB and seconds of CPU) that outlives a rank killed by SIGKILL. The writes here run in the
    rank's own process (`checkpoint_writer.CheckpointWriter`), so a plain queue carries the results."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _plan(
    tmp: Path, chunks: list[torch.nn.Module], optimizer: Any, optimizer_format: str, rank: int
) -> tuple[Any, dict[str, Any]]:
    """Plan the save of the model (and optimizer) into `tmp` and write the RNG states; returns Megatron's
    request for the tensor files and what the metadata records about the contents. Collective."""
    model_state = model_sharded_state_dict(chunks)
    state = dict(model_state)
    contents: dict[str, Any] = {"contents": ["model"]}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, metadata={"distrib_optim_sharding_type": optimizer_format}
        )
        contents = {"contents": ["model", "optimizer"], "optimizer_format": optimizer_format}
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    _write_results_in_process()
    request = dist_checkpointing.save(
        state, str(tmp), sharded_strategy=strategy, async_sharded_save=True, async_strategy="mcore"
    )
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    return request, contents


def save(
    actor: "MegatronActor",
    path: str | Path,
    extra_state: dict[str, Any],
    keep_last: int | None = None,
    with_optimizer: bool = True,
    optimizer_format: str = "dp_reshardable",
    background: bool = False,
) -> Path:
    """Checkpoint the whole actor state (model, optimizer, scheduler, step, RNG) and `extra_state`.

    `with_optimizer` False leaves out the optimizer state (3x the fp32 weights with Adam's two moments and the
    master weights): a resume then restarts Adam's moment estimates, as before the first step. `background`:
    see `save_state`; the actor's `checkpoint_writer` finishes it."""
    metadata = {
        "steps": actor.steps,
        "scheduler": actor.scheduler.state_dict(),
        **model_metadata(actor.arch, actor.layout, actor.dtype),
        "layer_spec": "transformer_engine" if actor.converter.te_layout else "local",
    }
    chunks = [c.module for c in actor.chunks]
    # Before its first step the optimizer holds no state (Megatron's distributed optimizer cannot even describe
    # it): such a checkpoint is the model alone, and loading it starts the optimizer afresh, as it was.
    optimizer = actor.optimizer if with_optimizer and has_optimizer_state(actor.optimizer, actor.device) else None
    return save_state(
        path,
        chunks,
        metadata,
        actor.hf_dir,
        optimizer,
        extra_state,
        keep_last,
        optimizer_format=optimizer_format,
        writer=actor.checkpoint_writer,
        background=background,
    )


def has_optimizer_state(optimizer: Any, device: torch.device) -> bool:
    """True once an optimizer step has created moment estimates on any rank (collective: ranks agree)."""
    local = any(opt.optimizer.state for opt in _inner_optimizers(optimizer))
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def model_metadata(arch: Architecture, layout: Layout, dtype: torch.dtype) -> dict[str, Any]:
    """What a checkpoint records about the model and the layout it was saved under."""
    return {
        "arch": dataclasses.asdict(arch),
        "padded_vocab_size": padded_vocab_size(arch.vocab_size, layout.tp),
        "dtype": str(dtype).removeprefix("torch."),
        "layout": _layout_record(layout),
    }


def _layout_record(layout: Layout) -> dict[str, int]:
    record = {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "vpp": layout.vpp}
    return record | ({"ep": layout.ep} if layout.ep > 1 else {})  # records without "ep" were saved at EP = 1


def load_model(path: str | Path, chunks: list[torch.nn.Module], arch: Architecture, tp: int) -> dict[str, Any]:
    """Load only the model weights of a checkpoint into `chunks` (unwrapped); returns its metadata."""
    ckpt = resolve(path)
    meta = read_metadata(ckpt)
    check_compatible(meta, arch, tp)
    state = _load(model_sharded_state_dict(chunks), ckpt)
    _load_model_state(chunks, state)
    return meta


def load(actor: "MegatronActor", path: str | Path, with_optimizer: bool = True) -> dict[str, Any]:
    """Restore the actor from a checkpoint (model only, if that is all it holds or `with_optimizer` is False);
    returns extra_state."""
    ckpt = resolve(path)
    meta = read_metadata(ckpt)
    check_compatible(meta, actor.arch, actor.layout.tp)
    chunks = [c.module for c in actor.chunks]
    model_state = model_sharded_state_dict(chunks)
    request = dict(model_state)
    with_optimizer = with_optimizer and "optimizer" in meta["contents"]
    if with_optimizer:
        optimizer_format = meta.get("optimizer_format", "fully_reshardable")
        _check_reshardable(meta, actor.layout, optimizer_format, ckpt)
        _prepare_optimizer_for_load(actor.optimizer)
        request["optimizer"] = actor.optimizer.sharded_state_dict(
            model_state, is_loading=True, metadata={"distrib_optim_sharding_type": optimizer_format}
        )
    state = _load(request, ckpt)
    _load_model_state(chunks, state)
    if with_optimizer:
        _load_optimizer_state(actor.optimizer, state["optimizer"])
    else:
        actor.optimizer.reload_model_params()  # refresh fp32 master copies from the loaded weights
    if "scheduler" in meta:  # an actor's checkpoint (a converted one has no schedule)
        actor.scheduler.load_state_dict(meta["scheduler"])
        actor.steps = meta["steps"]
    rng_file = ckpt / "rng" / f"rank_{actor.layout.rank:05d}.pt"
    if meta["layout"] == _layout_record(actor.layout) and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        log.info("checkpoint %s was saved under another layout: RNG states are not restored", ckpt)
    extra = ckpt / EXTRA_FILE
    log.info("loaded checkpoint %s (step %d)", ckpt, actor.steps)
    return json.loads(extra.read_text()) if extra.is_file() else {}


def _load(request: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """Megatron's load of `request`, each data-parallel rank reading a share and exchanging the rest, with the
    norms' keys mapped to the names the checkpoint has. Collective."""
    map_layer_names(request, set(dist_checkpointing.load_tensors_metadata(str(ckpt))))
    strategy = FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(ckpt)),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    return dist_checkpointing.load(request, str(ckpt), sharded_strategy=strategy)


def map_layer_names(request: dict[str, Any], stored: set[str]) -> list[str]:
    """Rename, in place, the requested norm tensors the checkpoint holds under the other layer spec's name
    (`NORM_ALIASES`); returns the renamed keys."""
    renamed = []
    for value in (v for v in nested_values(request) if isinstance(v, ShardedTensor)):
        alias = NORM_ALIASES.get(value.key)
        if value.key not in stored and alias in stored:
            renamed.append(value.key)
            value.key = alias
    return renamed


def _check_reshardable(meta: dict[str, Any], layout: Layout, optimizer_format: str, ckpt: Path) -> None:
    """A dp_reshardable optimizer state loads only under the same TP, PP, CP and virtual PP."""
    saved = {k: v for k, v in meta["layout"].items() if k != "world_size"}
    now = {k: v for k, v in _layout_record(layout).items() if k != "world_size"}
    if optimizer_format == "dp_reshardable" and saved != now:
        raise CheckpointError(
            f"{ckpt} holds its optimizer state in the dp_reshardable format, saved under {saved}: it resumes "
            f"only under that layout (any data-parallel size), not {now}. Resume under the saved layout, or set "
            "checkpoint.load_optimizer=false to load the weights and restart Adam's moments (save with "
            "checkpoint.optimizer_format=fully_reshardable to move a run between layouts)"
        )


def _load_model_state(chunks: list[torch.nn.Module], state: dict[str, Any]) -> None:
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys, strict=True):
        chunk.load_state_dict(state[key], strict=True)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _prepare_optimizer_for_load(optimizer: Any) -> None:
    """A fresh torch AdamW has no state yet; Megatron's loading path needs (dummy) state to fill in."""
    for opt in _inner_optimizers(optimizer):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    inner = _inner_optimizers(optimizer)
    originals = [_keep_unsaved_states(opt) for opt in inner]
    try:
        with torch.no_grad():  # fp32 master params are leaf views that require grad
            optimizer.load_state_dict(state)
    finally:
        for opt, original in zip(inner, originals, strict=True):
            if original is not None:
                opt._set_main_param_and_optimizer_states = original
    # torch AdamW keeps `step` per parameter (Megatron restores one tensor shared by all of them, which
    # AdamW would then increment once per parameter): give each parameter its own copy.
    for opt in inner:
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if p in opt.optimizer.state:
                    opt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def _keep_unsaved_states(opt: Any) -> Any:
    """With torch AdamW (no apex / TE), DistributedOptimizer's fully reshardable load expects a per-parameter
    `step` tensor that the checkpoint does not carry per parameter (KeyError 'step'). For this load only,
    let every state the checkpoint lacks keep its current value; returns the method to restore."""
    original = getattr(opt, "_set_main_param_and_optimizer_states", None)
    if original is None:
        return None

    def set_states(model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        group, order = opt.model_param_group_index_map[model_param]
        current = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
        original(model_param, {**current, **tensors})

    opt._set_main_param_and_optimizer_states = set_states
    return original


def _rng_state() -> dict[str, Any]:
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
