"""`userrl convert hf2mcore|mcore2hf`: Hugging Face <-> Megatron distributed checkpoints."""

import argparse


def _hf2mcore(args: argparse.Namespace) -> int:
    from userrl_megatron.config import ConfigError
    from userrl_megatron.convert.arch import UnsupportedModelError
    from userrl_megatron.errors import UserError
    from userrl_megatron.megatron.conversion import hf_to_mcore
    from userrl_megatron.model_store import resolve_model

    try:
        out = hf_to_mcore(resolve_model(args.hf), args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, ep=args.ep)
    except ConfigError:
        raise  # the CLI prints one line per layout problem
    except (UnsupportedModelError, FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    print(out)
    return 0


def _mcore2hf(args: argparse.Namespace) -> int:
    from userrl_megatron.config import ConfigError
    from userrl_megatron.errors import UserError
    from userrl_megatron.megatron.conversion import mcore_to_hf
    from userrl_megatron.run.checkpoint_files import CheckpointError

    try:
        out = mcore_to_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, ep=args.ep)
    except ConfigError:
        raise  # the CLI prints one line per layout problem
    except (CheckpointError, ValueError) as e:
        raise UserError(str(e)) from e
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `convert hf2mcore` and `convert mcore2hf`."""
    convert = sub.add_parser("convert", help="convert checkpoints between Hugging Face and Megatron")
    actions = convert.add_subparsers(dest="convert_command", required=True, metavar="ACTION")
    dtypes = ("float32", "bfloat16", "float16")

    to_mcore = actions.add_parser("hf2mcore", help="HF model directory -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model directory, or an embedded model name")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to write")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to shard with (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline stages to shard with (default 1)")
    to_mcore.add_argument(
        "--ep", type=int, default=1, help="expert-parallel ranks to shard MoE experts over (default 1)"
    )
    to_mcore.add_argument("--dtype", choices=dtypes, default="float32", help="parameter dtype (default float32)")
    to_mcore.set_defaults(handler=_hf2mcore)

    to_hf = actions.add_parser("mcore2hf", help="Megatron checkpoint -> HF model directory (safetensors)")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint directory, or a folder with a `latest` pointer")
    to_hf.add_argument("--out", required=True, help="HF model directory to write")
    to_hf.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to load with (default 1)")
    to_hf.add_argument("--pp", type=int, default=1, help="pipeline stages to load with (default 1)")
    to_hf.add_argument("--ep", type=int, default=1, help="expert-parallel ranks to load MoE experts with (default 1)")
    to_hf.add_argument("--dtype", choices=dtypes, default=None, help="cast the weights (default: as saved)")
    to_hf.set_defaults(handler=_mcore2hf)
