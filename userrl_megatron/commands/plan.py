"""`userrl plan`: what every GPU holds in every phase of a run, before anything is started."""

import argparse
import sys

from userrl_megatron.commands.config import add_config_args


def _plan(args: argparse.Namespace) -> int:
    from userrl_megatron.config import load_config
    from userrl_megatron.plan import format_plan, plan_problems, plan_run

    cfg = load_config(args.config, args.overrides)
    plan = plan_run(cfg)
    print(format_plan(plan, cfg))
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
    p.set_defaults(handler=_plan)
