"""`userrl gym list|play|smoke`: the registered gyms, playing one as the agent, scripted smoke episodes."""

import argparse
import sys
from typing import Any

from userrl_megatron.commands.config import add_config_args


def _list(args: argparse.Namespace) -> int:
    from gyms.base import gym_spec, list_gyms

    print(f"{'gym':12s} {'simulator':10s} {'config':16s} {'UserRL env':14s} smoke")
    for name in list_gyms():
        spec = gym_spec(name)
        smoke = len(spec.smoke()) if spec.smoke else 0
        sim = "yes" if spec.needs_user_sim else "no"
        config = f"gyms.{spec.config_field}"
        print(f"{name:12s} {sim:10s} {config:16s} {spec.userrl_env or '-':14s} {smoke} episodes")
    return 0


def _find_task(name: str, task_id: str | None, cfg: Any) -> Any:
    """The Task (or generated task id) to play: --task looked up in both splits, else the first test task."""
    from gyms.data import NoSuchSplitError
    from userrl_megatron.data import load_tasks
    from userrl_megatron.errors import UserError

    if task_id is None and name == "function":
        return load_tasks(["function-procedural"], "test", cfg.gyms)[0]
    for split in ("test", "train"):
        try:
            tasks = load_tasks([name], split, cfg.gyms)
        except NoSuchSplitError:
            continue
        if task_id is None:
            return tasks[0]
        match = next((t for t in tasks if t.task_id.lower() == task_id.lower()), None)
        if match is not None:
            return match
    if task_id is None:
        raise UserError(f"gym {name} has no tasks")
    return task_id  # generated ids (fgen-..., travel scenario ids) resolve in the gym itself


def _play(args: argparse.Namespace) -> int:
    import asyncio

    from gyms.base import gym_spec, make_gym
    from gyms.config import config_for
    from gyms.data import DataMissingError
    from gyms.user_sim import UserSimulator
    from userrl_megatron.config import load_config
    from userrl_megatron.errors import UserError

    cfg = load_config(args.config, args.overrides)
    spec = gym_spec(args.name)
    task = _find_task(args.name, args.task, cfg)
    sim = UserSimulator(cfg.user_sim) if spec.needs_user_sim else None
    try:
        gym = make_gym(args.name, task, config_for(args.name, cfg.gyms, cfg.rollout.max_turns), sim)
    except (KeyError, ValueError, DataMissingError) as e:  # an id found in neither split nor generated
        raise UserError(f"cannot start {args.name} on task {args.task!r}: not in its train or test split") from e
    if not isinstance(task, str):
        for message in task.prompt:
            print(f"[{message.role}]\n{message.content}\n")

    async def session() -> float:
        from gyms.user_sim import UserSimError
        from userrl_megatron.errors import UserError

        total = 0.0
        try:
            print(await gym.reset())  # a tau2 conversation's first message comes from the simulator
        except UserSimError as e:
            raise UserError(f"{args.name}: the user simulator failed at the start of the episode: {e}") from e
        print("Type actions like `[answer] 42`, `[action] ...`, `[search] ...` or `[finish]` (end of input stops).")
        while True:
            line = await asyncio.to_thread(_read_line)
            if line is None:
                break
            if not line.strip():
                continue
            result = await gym.step(line.strip())
            total += result.reward
            print(f"{result.feedback}\nReward: {result.reward}")
            if result.user_sim_error is not None:
                print(f"(user simulator error: {result.user_sim_error})", file=sys.stderr)
            if result.ended:
                print("The episode ended (" + ("done" if result.done else "step limit") + ").")
                break
        await gym.close()
        if sim is not None:
            await sim.close()
        return total

    print(f"Episode return: {asyncio.run(session())}")
    return 0


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None


def _smoke(args: argparse.Namespace) -> int:
    from gyms.base import list_gyms
    from gyms.smoke import run_smoke
    from userrl_megatron.errors import UserError

    names = args.gym or list_gyms()
    unknown = [n for n in names if n not in list_gyms()]
    if unknown:
        raise UserError(f"unknown gym(s) {unknown}; known: {', '.join(list_gyms())}")
    sim = None
    if args.live:
        from gyms.user_sim import UserSimulator
        from userrl_megatron.config import load_config

        sim = UserSimulator(load_config(args.config, args.overrides).user_sim)
    results = run_smoke(names, sim)
    print(f"{'gym':10s} {'episode':62s} {'steps':>5s} {'return':>7s} {'end':9s} result")
    for r in results:
        status = "ok" if r.ok else f"FAIL: {r.problem}"
        print(f"{r.gym:10s} {r.title[:62]:62s} {r.steps:5d} {r.total_reward:7.3f} {r.end:9s} {status}")
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed}/{len(results)} smoke episodes passed" + (" (live simulator)" if args.live else ""))
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `gym list`, `gym play NAME` and `gym smoke`."""
    gym = sub.add_parser("gym", help="list the gyms, play one as the agent, run the smoke episodes")
    actions = gym.add_subparsers(dest="gym_command", required=True, metavar="ACTION")
    actions.add_parser("list", help="registered gyms").set_defaults(handler=_list)

    play = actions.add_parser("play", help="play a gym as the agent in the terminal (simulator from the config)")
    play.add_argument("name", help="gym name (userrl gym list)")
    play.add_argument("--task", metavar="ID", help="task id or title (default: the first test task)")
    add_config_args(play)
    play.set_defaults(handler=_play)

    smoke = actions.add_parser("smoke", help="scripted episodes on every gym, with a table of results")
    smoke.add_argument("--gym", action="append", metavar="NAME", help="only this gym (repeatable)")
    smoke.add_argument("--live", action="store_true", help="use the configured user simulator (checks no crash only)")
    add_config_args(smoke)
    smoke.set_defaults(handler=_smoke)
