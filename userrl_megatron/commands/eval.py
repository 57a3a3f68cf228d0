"""`userrl eval`: evaluate a policy on the gyms' test tasks with UserRL's protocol and metrics (docs/eval.md).

    userrl eval --model NAME_OR_DIR --gyms function-procedural,telepathy --tasks 20 --out DIR
    userrl eval --endpoint URL --api-model NAME --gyms ... --out DIR
    userrl eval --compare DIR1 DIR2 ... --out DIR

Short forms are dotted overrides applied after the `key=value` ones. Rerunning the same command resumes from the
output directory's episode cache.
"""

import argparse
from pathlib import Path

from userrl_megatron.commands.config import add_config_args

# Short form -> the config key it sets.
SHORT_FORMS = {
    "model": "model.path",
    "tasks": "eval.max_tasks",
    "samples": "eval.n_samples_per_prompt",
    "temperature": "eval.temperature",
    "max_turns": "eval.max_turns",
    "out": "eval.out_dir",
    "endpoint": "eval.endpoint",
    "api_model": "eval.api_model",
    "engine_url": "eval.engine_url",
}


def short_overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides the short forms given on the command line stand for."""
    overrides = [f"{key}={getattr(args, name)}" for name, key in SHORT_FORMS.items() if getattr(args, name) is not None]
    if args.gyms is not None:
        sources = [s.strip() for s in args.gyms.split(",") if s.strip()]
        overrides.append(f"gyms.test=[{','.join(sources)}]")
    return overrides


def _eval(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from userrl_megatron.errors import UserError

    if args.compare:
        return _compare(args)
    if args.steps:
        return _steps(args)
    from userrl_megatron.eval.evaluation import eval_config, evaluate
    from userrl_megatron.eval.results import REPORT

    cfg = eval_config(args.config, [*args.overrides, *short_overrides(args)])
    if cfg.eval.endpoint and not cfg.eval.api_model:
        raise UserError("eval.endpoint needs eval.api_model (--api-model NAME): the model name sent to the endpoint")
    if cfg.eval.endpoint and cfg.eval.engine_url:
        raise UserError("eval.endpoint and eval.engine_url both name a policy: give one")
    if cfg.eval.api_tool_choice not in ("auto", "required"):
        raise UserError(f"eval.api_tool_choice must be auto or required, got {cfg.eval.api_tool_choice!r}")
    out = Path(cfg.eval.out_dir) if cfg.eval.out_dir else Path(cfg.run.output_dir) / cfg.run.name / "eval"
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from userrl_megatron.observability.noise import quiet_third_party

    quiet_third_party(level=cfg.logging.level)
    results = asyncio.run(evaluate(cfg, out))
    _print_table(results, f"{results['policy']['name']}: {results['seconds']:.1f} s")
    if not args.no_plot:
        from userrl_megatron.eval.plots import plot_results

        plot_results(results, out / "scores.png")
    print(f"results: {out / 'results.json'}, report: {out / REPORT}, episodes: {out / 'episodes.jsonl'}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from userrl_megatron.errors import UserError
    from userrl_megatron.eval.compare import compare_runs, write_comparison

    if len(args.compare) < 2:
        raise UserError(f"--compare needs at least two evaluation directories, got {len(args.compare)}")
    if not args.out:
        raise UserError("--compare needs --out DIR for the comparison table and chart")
    comparison = compare_runs([Path(d) for d in args.compare])
    out = Path(args.out)
    write_comparison(comparison, out, plot=not args.no_plot)
    print((out / "compare.md").read_text(encoding="utf-8"))
    return 0


def _steps(args: argparse.Namespace) -> int:
    from userrl_megatron.errors import UserError
    from userrl_megatron.eval.plots import plot_steps
    from userrl_megatron.eval.results import step_results

    steps = step_results(Path(args.steps))
    if not steps:
        raise UserError(f"{args.steps} holds no eval/step_N/results.json (a run with eval.every_steps > 0 writes them)")
    out = Path(args.out) if args.out else Path(args.steps) / "eval"
    path = plot_steps(steps, out / "steps.png")
    for step, results in steps:
        scores = ", ".join(f"{g} {e['metrics']['mean']:.3f}" for g, e in results["gyms"].items() if e["items"])
        print(f"step {step}: {scores}")
    print(f"chart: {path}")
    return 0


def _print_table(results: dict, title: str) -> None:
    from userrl_megatron.eval.results import markdown_table, report_rows

    print(title)
    print(markdown_table(*report_rows(results)))


def register(sub: argparse._SubParsersAction) -> None:
    """Add `eval`."""
    p = sub.add_parser("eval", help="evaluate a policy on the gyms' test tasks (UserRL's protocol and metrics)")
    add_config_args(p)
    p.add_argument("--model", default=None, metavar="M", help="policy: HF dir, Megatron checkpoint or embedded model")
    p.add_argument("--gyms", default=None, metavar="A,B", help="test sources, comma-separated (gyms.test)")
    p.add_argument("--tasks", type=int, default=None, metavar="N", help="first N tasks of each source (0 = all)")
    p.add_argument("--samples", type=int, default=None, metavar="K", help="episodes per task (pass@k, pass^k)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (eval.temperature)")
    p.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (eval.max_turns)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (eval.out_dir); resumes when rerun")
    p.add_argument("--endpoint", default=None, metavar="URL", help="OpenAI-compatible chat endpoint as the policy")
    p.add_argument("--api-model", default=None, metavar="NAME", help="model name sent to --endpoint")
    p.add_argument("--engine-url", default=None, metavar="URL", help="a running engine (native API) as the policy")
    p.add_argument("--compare", nargs="+", default=None, metavar="DIR", help="compare finished evaluation dirs")
    p.add_argument("--steps", default=None, metavar="RUN_DIR", help="chart a training run's step evaluations")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG charts")
    p.set_defaults(handler=_eval)
