"""HF <-> Megatron checkpoint converters (`userrl convert hf2mcore|mcore2hf`, tools/convert_*.py).

hf2mcore builds the Megatron model under the requested TP x PP (x EP) layout on TP x PP x EP local ranks (EP:
expert parallelism of MoE models, over EP data-parallel ranks), loads each
rank's shard of the HF weights (conversion rules in `userrl_megatron.convert`) and writes a model-only
distributed checkpoint, which the actor can load under any layout (`MegatronActor.load`). mcore2hf loads
such a checkpoint (or a training checkpoint) under a TP x PP x EP layout (1 x 1 x 1 by default), gathers the full
HF tensors on rank 0 and writes safetensors shards, config.json, the generation config and the tokenizer
files (copied from the checkpoint's `hf/` folder), loadable by `transformers`.

Ranks are local processes: gloo on CPU, one GPU each (NCCL) when CUDA is available.
"""

import logging
from pathlib import Path

from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron.launch import run_local

log = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def hf_to_mcore(
    hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, dtype: str = "float32", ep: int = 1
) -> Path:
    """Convert the HF model in `hf_dir` into a Megatron checkpoint at `out_dir`, sharded TP x PP (x EP)."""
    hf_dir, out_dir = Path(hf_dir).absolute(), Path(out_dir).absolute()
    _check_request(hf_dir, tp, pp, dtype, ep)
    run_local(_hf_to_mcore_rank, tp * pp * ep, str(hf_dir), str(out_dir), tp, pp, dtype, ep, threads_per_rank=None)
    return out_dir


def mcore_to_hf(
    ckpt: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, dtype: str | None = None, ep: int = 1
) -> Path:
    """Convert a Megatron checkpoint (or a folder with a `latest` pointer) into an HF directory `out_dir`.

    `dtype` casts the weights (default: the checkpoint's dtype)."""
    from userrl_megatron.run import checkpoint_files

    ckpt_dir = checkpoint_files.resolve(ckpt).absolute()
    meta = checkpoint_files.read_metadata(ckpt_dir)
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    _check_layout(Architecture(**meta["arch"]), tp, pp, ep)
    out_dir = Path(out_dir).absolute()
    run_local(_mcore_to_hf_rank, tp * pp * ep, str(ckpt_dir), str(out_dir), tp, pp, dtype or meta["dtype"], ep)
    return out_dir


def _check_request(hf_dir: Path, tp: int, pp: int, dtype: str, ep: int) -> None:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    _check_layout(Architecture.from_hf_dir(hf_dir), tp, pp, ep)


def _check_layout(arch: Architecture, tp: int, pp: int, ep: int) -> None:
    from userrl_megatron.megatron.parallel import check_layout, check_model_layout

    cfg = _config(tp, pp, ep)
    check_layout(cfg, tp * pp * ep)
    check_model_layout(cfg, arch)


def _config(tp: int, pp: int, ep: int = 1) -> MegatronConfig:
    return MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        devices_per_node=tp * pp * ep,  # EP ranks are data-parallel ranks: dp = ep
        use_distributed_optimizer=False,
    )


def _hf_to_mcore_rank(
    rank: int, world_size: int, port: int, hf_dir: str, out_dir: str, tp: int, pp: int, dtype: str, ep: int
) -> None:
    from userrl_megatron.megatron import parallel

    cfg = _config(tp, pp, ep)
    layout = parallel.initialize(cfg, rank=rank, world_size=world_size, master_port=port)
    from userrl_megatron.convert.hf_io import HFWeights
    from userrl_megatron.convert.rules import Converter
    from userrl_megatron.megatron import checkpoint
    from userrl_megatron.megatron.model import DTYPES, HFSource, build_chunks, load_full_weights, use_transformer_engine

    try:
        arch = Architecture.from_hf_dir(hf_dir)
        use_te = use_transformer_engine(cfg.transformer_impl)
        converter = Converter(arch, te_layout=use_te)
        chunks = build_chunks(arch, cfg, DTYPES[dtype], use_te)
        load_full_weights(chunks, HFSource(HFWeights(hf_dir), converter), converter, layout.tp_rank, layout.tp)
        metadata = {"steps": 0, **checkpoint.model_metadata(arch, layout, DTYPES[dtype])}
        checkpoint.save_state(out_dir, chunks, metadata, Path(hf_dir), pointer=False)  # writes only under out_dir
    finally:
        parallel.shutdown()


def _mcore_to_hf_rank(
    rank: int, world_size: int, port: int, ckpt: str, out_dir: str, tp: int, pp: int, dtype: str, ep: int
) -> None:
    from userrl_megatron.megatron import parallel

    cfg = _config(tp, pp, ep)
    layout = parallel.initialize(cfg, rank=rank, world_size=world_size, master_port=port)
    from userrl_megatron.convert.rules import Converter
    from userrl_megatron.megatron import checkpoint
    from userrl_megatron.megatron.export import export_hf_dir
    from userrl_megatron.megatron.model import DTYPES, build_chunks, use_transformer_engine
    from userrl_megatron.run import checkpoint_files

    try:
        meta = checkpoint_files.read_metadata(ckpt)
        arch = Architecture(**meta["arch"])
        use_te = use_transformer_engine(cfg.transformer_impl)
        chunks = build_chunks(arch, cfg, DTYPES[meta["dtype"]], use_te)
        checkpoint.load_model(ckpt, chunks, arch, layout.tp)
        converter = Converter(arch, te_layout=use_te)
        export_hf_dir(chunks, converter, layout, out_dir, checkpoint_files.hf_metadata_dir(ckpt), DTYPES[dtype])
        if rank == 0:
            log.info("wrote %s", out_dir)
    finally:
        parallel.shutdown()
