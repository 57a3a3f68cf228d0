"""`userrl train --config ... [k=v ...]`: GRPO training; relaunching the same command resumes the run."""

import argparse

from userrl_megatron.commands.config import add_config_args


def _train(args: argparse.Namespace) -> int:
    import logging

    from userrl_megatron.config import load_config
    from userrl_megatron.observability.noise import quiet_third_party
    from userrl_megatron.observability.run_log import run_log
    from userrl_megatron.trainer.preflight import check_before_start, finished_step, run_directory
    from userrl_megatron.trainer.report import print_report

    cfg = load_config(args.config, args.overrides)
    run_dir = run_directory(cfg)
    step = finished_step(cfg)  # a finished run starts nothing (not even torch) and reprints its table
    if step is None:
        from userrl_megatron.fleet.gpu_preflight import gpus_before_ray

        check_before_start(cfg, on_gpu=gpus_before_ray(cfg.run))  # checked again once Ray has said
        from userrl_megatron.memory_limit import check_host_memory

        check_host_memory(cfg)  # under a Slurm or cgroup memory limit: the plan's pinned host memory fits it
    with run_log(run_dir / "run.log"):
        logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        quiet_third_party(level=cfg.logging.level)
        if step is not None:
            from userrl_megatron.actors.run_lock import RunLock

            with RunLock(run_dir):  # a run still using the directory is not finished: its holder is named
                logging.getLogger(__name__).info(
                    "%s already finished at step %d (run.total_steps = %d): nothing to start; "
                    "append run.total_steps=N to train further",
                    run_dir,
                    step,
                    cfg.run.total_steps,
                )
        else:
            from userrl_megatron.trainer.driver import train

            train(cfg)
        print_report(run_dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `train`."""
    p = sub.add_parser("train", help="train with multi-turn GRPO (resumes from the run's latest checkpoint)")
    add_config_args(p)
    p.set_defaults(handler=_train)
