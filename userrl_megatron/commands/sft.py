"""`userrl sft --config ... [k=v ...]`: supervised fine-tuning on chat data; relaunching resumes the run."""

import argparse

from userrl_megatron.commands.config import add_config_args


def _sft(args: argparse.Namespace) -> int:
    import logging

    from userrl_megatron.config import load_config
    from userrl_megatron.observability.noise import quiet_third_party
    from userrl_megatron.observability.run_log import run_log
    from userrl_megatron.trainer.preflight import check_before_start, run_directory

    cfg = load_config(args.config, args.overrides, command="sft")
    from userrl_megatron.fleet.gpu_preflight import gpus_before_ray

    check_before_start(cfg, on_gpu=gpus_before_ray(cfg.run))  # checked again once Ray has said
    with run_log(run_directory(cfg) / "run.log"):
        logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        quiet_third_party(level=cfg.logging.level)
        from userrl_megatron.sft.trainer import run_sft

        run_dir = run_sft(cfg)
        print(f"sft run: {run_dir} (checkpoints/latest, hf/)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `sft`."""
    p = sub.add_parser(
        "sft", help="supervised fine-tuning on multi-turn chat data (resumes from the run's latest checkpoint)"
    )
    add_config_args(p)
    p.set_defaults(handler=_sft)
