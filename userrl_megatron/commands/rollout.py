"""`userrl rollout [--model M] [--config ...] [k=v ...]`: run episodes of a dataset on the engine pool, no training.

Writes every episode (each turn's tokens, text, reward and timing) to rollouts.jsonl and prints a per-gym
summary table with the run's throughput.
"""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from userrl_megatron.commands.config import add_config_args

if TYPE_CHECKING:
    from userrl_megatron.config.schema import RootConfig
    from userrl_megatron.rollout.chat import ChatTemplate
    from userrl_megatron.types import Episode, EpisodeGroup, Task


def _rollout(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import time

    from userrl_megatron.config import load_config
    from userrl_megatron.data import load_tasks
    from userrl_megatron.errors import UserError
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.observability.dumps import write_episodes
    from userrl_megatron.rollout.chat import ChatTemplate, ChatTemplateError

    model = [f"model.path={args.model}"] if args.model else []
    cfg = load_config(args.config, [*args.overrides, *model], command="rollout")
    if args.samples < 1 or args.limit < 0:
        raise UserError(f"--samples must be >= 1 and --limit >= 0, got {args.samples} and {args.limit}")
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from userrl_megatron.observability.noise import quiet_third_party

    quiet_third_party(level=cfg.logging.level)
    sources = cfg.gyms.test if args.split == "test" else cfg.gyms.train
    tasks = load_tasks(sources, args.split, cfg.gyms)
    tasks = tasks[: args.limit] if args.limit > 0 else tasks
    if not tasks:
        raise UserError(f"no {args.split} tasks in {sources}")
    model_dir = resolve_model(cfg.model.path)
    chat = ChatTemplate.from_pretrained(model_dir, cfg.model.tool_format)
    try:
        for task in tasks:
            chat.present(task.prompt, task.tools)
    except ChatTemplateError as e:
        raise UserError(str(e)) from e
    out = Path(args.out) if args.out else Path(cfg.run.output_dir) / cfg.run.name / "rollouts.jsonl"
    started = time.perf_counter()
    groups = asyncio.run(_collect(cfg, str(model_dir), chat, tasks, args.samples, out.parent / "engines"))
    seconds = time.perf_counter() - started
    episodes = [e for g in groups for e in g.episodes]
    out.unlink(missing_ok=True)
    write_episodes(out, episodes)
    _print_summary(episodes, seconds, out)
    return 0


async def _collect(
    cfg: "RootConfig", model_dir: str, chat: "ChatTemplate", tasks: "list[Task]", samples: int, log_dir: Path
) -> "list[EpisodeGroup]":
    """Start the pool (and the user simulator when a gym needs one), run the episodes, shut everything down."""
    from userrl_megatron.fleet.simulator import user_simulator
    from userrl_megatron.fleet.standalone import standalone_pool
    from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory

    async with user_simulator(cfg, (t.gym for t in tasks), log_dir) as user_sim:
        runner = EpisodeRunner(cfg.rollout, chat, gym_factory(cfg.gyms, cfg.rollout.max_turns, user_sim))
        managed = user_sim is not None and bool(cfg.user_sim.engines.model)
        async with standalone_pool(cfg, model_dir, log_dir, beside_simulator=managed) as pool:
            return await runner.run_groups(tasks, samples, pool.session, concurrency=pool.concurrency)


def _print_summary(episodes: "list[Episode]", seconds: float, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from userrl_megatron.rollout.summary import summarize

    table = Table(title=f"{len(episodes)} episodes in {seconds:.1f} s")
    for column in ("gym", "episodes", "reward", "positive", "turns", "generated", "finish"):
        table.add_column(column, justify="left" if column in ("gym", "finish") else "right")
    rows = summarize(episodes)
    for row in rows:
        finish = ", ".join(f"{reason} {n}" for reason, n in row.finish.items())
        table.add_row(
            row.gym,
            str(row.episodes),
            f"{row.reward_mean:.3f}",
            f"{row.positive:.1%}",
            f"{row.turns_mean:.2f}",
            str(row.generated_tokens),
            finish,
        )
    console = Console(highlight=False)
    console.print(table)
    generated = rows[-1].generated_tokens if rows else 0
    console.print(
        f"throughput: {generated / seconds:.1f} generated tokens/s, {len(episodes) / seconds:.2f} episodes/s; "
        f"episodes written to {out}"
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add `rollout`."""
    p = sub.add_parser("rollout", help="run episodes of a dataset on the engine pool (no training)")
    add_config_args(p)
    p.add_argument("--model", default=None, metavar="M", help="policy: HF dir or embedded model (model.path)")
    p.add_argument("--split", choices=("train", "test"), default="test", help="gyms.train or gyms.test sources")
    p.add_argument("--limit", type=int, default=0, help="first N tasks only (0 = all)")
    p.add_argument("--samples", type=int, default=1, help="episodes per task")
    p.add_argument("--out", default="", help="episode dump (default <run.output_dir>/<run.name>/rollouts.jsonl)")
    p.set_defaults(handler=_rollout)
