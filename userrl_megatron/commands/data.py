"""`userrl data fetch|verify|build|list`: the public data and the task rows built from it."""

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from userrl_megatron.commands.config import add_config_args

if TYPE_CHECKING:
    from userrl_megatron.config.schema import RootConfig
    from userrl_megatron.rollout.chat import ChatTemplate

GROUPS = ("userrl", "taubench")


def _data_root(args: argparse.Namespace) -> Path:
    from gyms.data import data_dir
    from userrl_megatron.config import load_config

    return data_dir(load_config(args.config, args.overrides).gyms.data_dir)


def _fetch(args: argparse.Namespace) -> int:
    from userrl_megatron.data.fetch import fetch

    dest = Path(args.dest).expanduser() if args.dest else _data_root(args)
    source = Path(args.source).expanduser() if args.source else None
    counts = fetch(dest, source, tuple(args.only or GROUPS), force=args.force)
    done = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    print(f"data in {dest}: {done}; every file matches its sha256")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from userrl_megatron.data.fetch import verify

    root = Path(args.dir).expanduser() if args.dir else _data_root(args)
    states = verify(root, tuple(args.only or GROUPS))
    bad = {path: state for path, state in states.items() if state != "ok"}
    for path, state in sorted(bad.items()):
        print(f"{state:8s} {path}")
    print(f"{len(states) - len(bad)}/{len(states)} files ok in {root}")
    if bad:
        print("fix with `userrl data fetch` (add --from DIR to copy a local copy)", file=sys.stderr)
    return 1 if bad else 0


def _build(args: argparse.Namespace) -> int:
    from gyms.data import data_dir
    from userrl_megatron.config import load_config
    from userrl_megatron.data.build import FORMATS, build_rows

    gyms_cfg = load_config(args.config, args.overrides).gyms
    out = Path(args.out).expanduser() if args.out else data_dir(gyms_cfg.data_dir) / "rows"
    formats = tuple(args.format or FORMATS)
    built = build_rows(gyms_cfg, out, args.source or None, formats)
    print(f"{'source':22s} {'split':6s} {'rows':>6s}")
    for b in built:
        print(f"{b.source:22s} {b.split:6s} {b.rows:6d}")
    print(f"rows written under {out} ({', '.join(formats)})")
    return 0


def _list(args: argparse.Namespace) -> int:
    from gyms.base import gym_spec, list_gyms
    from userrl_megatron.data import procedural_sources
    from userrl_megatron.data.mixtures import MIXTURES

    for name in list_gyms():
        kind = "gym (public data)" if gym_spec(name).tasks is not None else "gym (no task list)"
        print(f"{name:22s} {kind}")
    for name in procedural_sources():
        print(f"{name:22s} procedural (no data needed)")
    for name, (_, split) in MIXTURES.items():
        print(f"{name:22s} mixture ({split} split)")
    print(f"{'<path>.parquet|.jsonl':22s} row file (userrl data build, or UserRL parquet rows)")
    return 0


def _chat(args: argparse.Namespace) -> tuple["RootConfig", "ChatTemplate"]:
    """The config and the policy's chat template (model.path, model.tool_format): SFT rows are written for it."""
    from userrl_megatron.config import load_config
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.rollout.chat import ChatTemplate

    cfg = load_config(args.config, args.overrides)
    return cfg, ChatTemplate.from_pretrained(resolve_model(cfg.model.path), cfg.model.tool_format)


def _sft_from_rollouts(args: argparse.Namespace) -> int:
    from userrl_megatron.sft.from_rollouts import dump_files, select, summary
    from userrl_megatron.sft.rows import write_rows

    _, chat = _chat(args)
    selection = select(args.run_dir, chat, args.min_reward, args.best_per_group)
    for rejection in selection.rejected:
        print(f"rejected {rejection}", file=sys.stderr)
    out = write_rows(Path(args.out).expanduser(), selection.rows)
    print(f"{summary(selection, dump_files(args.run_dir))}; written to {out}")
    return 0 if selection.rows else 1


def _sft_expert(args: argparse.Namespace) -> int:
    from userrl_megatron.sft.experts import expert_rows
    from userrl_megatron.sft.rows import write_rows

    cfg, chat = _chat(args)
    try:
        rows = expert_rows(args.source, args.split, cfg.gyms, cfg.rollout, chat, args.tasks)
    except ValueError as e:
        from userrl_megatron.errors import UserError

        raise UserError(str(e)) from e
    out = write_rows(Path(args.out).expanduser(), rows)
    print(f"{len(rows)} solved expert episodes of {args.source} ({args.split}) written to {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `data fetch`, `data verify`, `data build`, `data list`, `data sft-from-rollouts` and `data sft-expert`."""
    data = sub.add_parser("data", help="fetch and verify the public data, build task rows")
    actions = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    fetch = actions.add_parser("fetch", help="download (or copy with --from) the public data, checking sha256")
    add_config_args(fetch)
    fetch.add_argument("--from", dest="source", metavar="DIR", help="copy from a local copy (e.g. ../shared/data)")
    fetch.add_argument("--dest", metavar="DIR", help="data folder to fill (default: gyms.data_dir or the cache)")
    fetch.add_argument("--only", action="append", choices=GROUPS, help="data group to fetch (repeatable; default all)")
    fetch.add_argument("--force", action="store_true", help="fetch again even files that are present and valid")
    fetch.set_defaults(handler=_fetch)

    verify = actions.add_parser("verify", help="check the data folder against the manifest")
    add_config_args(verify)
    verify.add_argument("--dir", metavar="DIR", help="data folder (default: gyms.data_dir or the cache)")
    verify.add_argument("--only", action="append", choices=GROUPS, help="data group to check (repeatable; default all)")
    verify.set_defaults(handler=_verify)

    build = actions.add_parser("build", help="write task rows (parquet / jsonl) per source and split")
    add_config_args(build)
    build.add_argument("--out", metavar="DIR", help="output folder (default: <data folder>/rows)")
    build.add_argument("--source", action="append", metavar="NAME", help="source to build (repeatable; default all)")
    build.add_argument("--format", action="append", choices=("parquet", "jsonl"), help="row format (default both)")
    build.set_defaults(handler=_build)

    actions.add_parser("list", help="the task sources gyms.train / gyms.test accept").set_defaults(handler=_list)

    rft = actions.add_parser(
        "sft-from-rollouts", help="SFT rows (jsonl) from a run's rollout dumps: rejection-sampling fine-tuning data"
    )
    rft.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="run directory (its rollouts/step_N.jsonl), or one episode file (rollouts.jsonl, episodes.jsonl)",
    )
    add_config_args(rft)
    rft.add_argument("--min-reward", type=float, default=1.0, help="keep episodes whose reward is at least this")
    rft.add_argument("--best-per-group", action="store_true", help="keep only the best kept episode of each group")
    rft.add_argument("--out", required=True, metavar="FILE", help="output .jsonl file")
    rft.set_defaults(handler=_sft_from_rollouts)

    expert = actions.add_parser("sft-expert", help="SFT rows (jsonl) of a scripted expert's solved episodes")
    add_config_args(expert)
    expert.add_argument("--source", default="function-procedural", help="task source with an expert (FunctionGym)")
    expert.add_argument("--split", default="train", choices=("train", "test"), help="split of the source")
    expert.add_argument("--tasks", type=int, default=0, help="first N tasks of the split (0 = all)")
    expert.add_argument("--out", required=True, metavar="FILE", help="output .jsonl file")
    expert.set_defaults(handler=_sft_expert)
