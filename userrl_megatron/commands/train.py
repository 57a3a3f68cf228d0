"""`userrl train --config ... [k=v ...]`: GRPO training; relaunching the same command resumes the run."""

import argparse

from userrl_megatron.commands.config import add_config_args


def _train(args: argparse.Namespace) -> int:
    import logging

    from userrl_megatron.config import load_config
    from userrl_megatron.trainer.driver import train
    from userrl_megatron.trainer.report import print_report

    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = train(cfg)
    print_report(run_dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `train`."""
    p = sub.add_parser("train", help="train with multi-turn GRPO (resumes from the run's latest checkpoint)")
    add_config_args(p)
    p.set_defaults(handler=_train)
