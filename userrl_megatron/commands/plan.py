"""`userrl plan`: what every GPU holds in every phase of a run, before anything is started; with `--placement`,
where every process of the run goes and what it runs (a simulated cluster of the run's shape, `trainer/dry_run.py`)."""

import argparse
import sys

from userrl_megatron.commands.config import add_config_args


def _plan(args: argparse.Namespace) -> int:
    from userrl_megatron.config import load_config
    from userrl_megatron.plan import format_plan, plan_problems, plan_run, plan_warnings

    cfg = load_config(args.config, args.overrides)
    if args.placement:
        import contextlib

        from userrl_megatron.trainer.dry_run import format_placement, simulate

        with contextlib.redirect_stdout(sys.stderr):  # what Ray's driver prints is not part of the answer
            placed = simulate(cfg)
        print(format_placement(placed))
        return 0
    plan = plan_run(cfg)
    print(format_plan(plan, cfg))
    for warning in plan_warnings(plan):
        print(f"userrl: warning: {warning}", file=sys.stderr)
    problems = plan_problems(plan)
    for problem in problems:
        print(f"userrl: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `plan`."""
    p = sub.add_parser(
        "plan", help="per-phase GPU memory of a run (weights, grads, optimizer, activations, engine KV) and its peak"
    )
    add_config_args(p)
    p.add_argument(
        "--placement",
        action="store_true",
        help="instead: one line per process (node, visible GPUs, parallel ranks or command line), from the run's "
        "start-up on a simulated cluster of its shape (Ray, no GPU touched; tens of seconds)",
    )
    p.set_defaults(handler=_plan)
