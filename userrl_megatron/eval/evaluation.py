"""`evaluate(cfg, out_dir)`: the whole of `userrl eval` below the command line.

Tasks: the first `eval.max_tasks` of each `gyms.test` source (test split). Protocol: `eval.max_turns` turns
(0: `rollout.max_turns`), `eval.n_samples_per_prompt` samples per task at `eval.temperature`, gym feedback with
or without the reward (`eval.reward_in_feedback`), the gyms' evaluation-time settings (`eval.gym_settings`,
applied by `eval_config`). Policy: `eval.endpoint` (OpenAI-compatible chat), else `eval.engine_url` (a running
engine's native API), else `model.path` served by the rollout pool (`rollout.backend`).
"""

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from userrl_megatron.config.schema import RolloutConfig, RootConfig
from userrl_megatron.errors import UserError
from userrl_megatron.eval.cache import EpisodeCache
from userrl_megatron.eval.policy import Policy, TokenPolicy, weights_fingerprint
from userrl_megatron.eval.results import (
    CI_METHOD,
    EPISODES,
    REPORT,
    RESULTS,
    aggregate,
    report_markdown,
    write_episodes_jsonl,
)
from userrl_megatron.eval.run import plan_jobs, run_jobs
from userrl_megatron.types import SamplingParams, Task

log = logging.getLogger(__name__)

CACHE = "cache.jsonl"
VERSIONED = ("userrl_megatron", "torch", "transformers", "megatron-core", "sglang", "openai", "ray")


def eval_config(files: Sequence[str], overrides: Sequence[str]) -> RootConfig:
    """The configuration `userrl eval` runs with: files, then `eval.gym_settings` on the gyms section, then the
    command line's overrides (which therefore win over both)."""
    from userrl_megatron.config import load_config

    first = load_config(files, overrides, command="eval")
    settings = [f"gyms.{s}" for s in first.eval.gym_settings]
    return load_config(files, [*settings, *overrides], command="eval") if settings else first


def eval_tasks(cfg: RootConfig) -> list[Task]:
    """The first `eval.max_tasks` test tasks of each `gyms.test` source (all with 0), in source order."""
    from userrl_megatron.data import load_tasks

    tasks: list[Task] = []
    for source in cfg.gyms.test:
        found = load_tasks([source], "test", cfg.gyms)
        tasks += found[: cfg.eval.max_tasks] if cfg.eval.max_tasks else found
    return tasks


def eval_rollout(cfg: RootConfig) -> RolloutConfig:
    """The rollout settings of evaluation episodes."""
    return dataclasses.replace(
        cfg.rollout,
        max_turns=cfg.eval.max_turns or cfg.rollout.max_turns,
        temperature=cfg.eval.temperature,
        reward_in_feedback=cfg.eval.reward_in_feedback,
    )


def simulator_identity(cfg: RootConfig) -> dict[str, Any]:
    """What of the user simulator can change an episode's result: the endpoint and model name, or, for engines the
    run serves (`user_sim.engines.model`), the model they serve and its dtype (`user_sim.base_url` and
    `user_sim.model` are not used then: two evaluations with different simulator models must not share cached
    episodes)."""
    sim = cfg.user_sim
    served: dict[str, Any]
    if sim.engines.model:
        served = {"engines": {"model": sim.engines.model, "dtype": sim.engines.dtype or cfg.model.dtype}}
    else:
        served = {"base_url": sim.base_url, "model": sim.model}
    return {
        **served,
        "temperature": sim.temperature,
        "max_tokens": sim.max_tokens,
        "disable_thinking": sim.disable_thinking,
        "structured": sim.structured_mode,
    }


def versions() -> dict[str, str]:
    """Installed versions of the packages that shape results (absent ones left out)."""
    found = {}
    for name in VERSIONED:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def policy_model_dir(cfg: RootConfig, out_dir: Path) -> Path:
    """The HF directory that serves `model.path`: the directory or embedded model itself, or, for a Megatron
    checkpoint (a folder with `userrl_checkpoint.json` or a `latest` pointer), its HF conversion under
    `<out>/policy_hf/<fingerprint>/`, converted once (`userrl convert mcore2hf`) and reused by reruns."""
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.run import checkpoint_files

    path = Path(cfg.model.path).expanduser()
    try:
        ckpt = checkpoint_files.resolve(path) if path.is_dir() else None
    except checkpoint_files.CheckpointError:
        ckpt = None
    if ckpt is None:
        return resolve_model(cfg.model.path)
    target = out_dir / "policy_hf" / weights_fingerprint(ckpt)
    if not (target / "config.json").is_file():
        from userrl_megatron.megatron.conversion import mcore_to_hf

        log.info("model.path %s is a Megatron checkpoint: converting %s to %s", path, ckpt, target)
        tmp = target.with_name(target.name + ".partial")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mcore_to_hf(ckpt, tmp)
        except (checkpoint_files.CheckpointError, ValueError) as e:
            raise UserError(f"model.path {path}: {e}") from e
        tmp.replace(target)
    return target


async def policy_identity(cfg: RootConfig, model_dir: Path | None) -> dict[str, Any]:
    """What names the policy in results.json and in every cache key (known before any engine starts)."""
    if cfg.eval.endpoint:
        from userrl_megatron.eval.api_policy import api_identity

        return api_identity(cfg.eval)
    tokenizer = {"tokenizer": cfg.model.path, "tool_format": cfg.model.tool_format}
    if cfg.eval.engine_url:
        from userrl_megatron.fleet.engine import SGLangClient
        from userrl_megatron.wire.generation import EngineError

        async with SGLangClient(cfg.eval.engine_url, timeout_s=30.0, api_key=engine_url_key(cfg)) as client:
            try:
                info = await client.get_model_info()
            except EngineError as e:
                raise UserError(f"eval.engine_url = {cfg.eval.engine_url}: no engine answers there ({e})") from e
        return {
            "kind": "engine",
            "url": cfg.eval.engine_url,
            "model_info": info,
            "tokenizer": cfg.model.path,
            **tokenizer,
        }
    assert model_dir is not None
    return {
        "kind": "model",
        "path": str(model_dir),
        "source": cfg.model.path,
        "fingerprint": weights_fingerprint(model_dir),
        "dtype": cfg.model.dtype,
        "backend": cfg.rollout.backend,
        **tokenizer,
    }


@contextlib.asynccontextmanager
async def open_policy(
    cfg: RootConfig,
    rollout: RolloutConfig,
    identity: dict[str, Any],
    model_dir: Path | None,
    user_sim: Any,
    log_dir: Path,
) -> AsyncIterator[Policy]:
    """The policy `cfg` names, started (engines, HTTP clients) for the block and stopped after it."""
    from userrl_megatron.rollout.episode import gym_factory

    make_gym = gym_factory(cfg.gyms, rollout.max_turns, user_sim)
    if cfg.eval.endpoint:
        from userrl_megatron.eval.api_policy import ApiPolicy

        async with ApiPolicy(cfg.eval, rollout, make_gym) as api:
            yield api
        return
    from userrl_megatron.rollout.chat import ChatTemplate
    from userrl_megatron.rollout.episode import EpisodeRunner

    assert model_dir is not None
    runner = EpisodeRunner(rollout, ChatTemplate.from_pretrained(model_dir, cfg.model.tool_format), make_gym)
    if cfg.eval.engine_url:
        from userrl_megatron.fleet.engine import SGLangClient

        key = engine_url_key(cfg)
        async with SGLangClient(cfg.eval.engine_url, timeout_s=rollout.request_timeout_s, api_key=key) as client:
            yield TokenPolicy(runner, lambda _: client, identity, rollout.max_concurrent_episodes)
        return
    from userrl_megatron.fleet.standalone import standalone_pool

    managed = user_sim is not None and bool(cfg.user_sim.engines.model)
    async with standalone_pool(cfg, str(model_dir), log_dir, beside_simulator=managed) as pool:
        yield TokenPolicy(runner, pool.session, identity, pool.concurrency)


def check_tasks(cfg: RootConfig, tasks: list[Task], model_dir: Path | None) -> None:
    """Fail before anything starts when the policy's chat template cannot show a task (token policies only)."""
    if model_dir is None:
        return
    from userrl_megatron.rollout.chat import ChatTemplate, ChatTemplateError

    chat = ChatTemplate.from_pretrained(model_dir, cfg.model.tool_format)
    try:
        for task in tasks:
            chat.present(task.prompt, task.tools)
    except ChatTemplateError as e:
        raise UserError(str(e)) from e


async def evaluate(cfg: RootConfig, out_dir: Path) -> dict[str, Any]:
    """Run (or resume) the evaluation `cfg` describes into `out_dir`; returns the results (also results.json)."""
    from gyms import config_for
    from gyms.base import gym_spec
    from userrl_megatron.fleet.simulator import user_simulator

    tasks = eval_tasks(cfg)
    if not tasks:
        raise UserError(f"no test tasks in {cfg.gyms.test}")
    if cfg.eval.endpoint:
        model_dir = None
    elif cfg.eval.engine_url:
        from userrl_megatron.model_store import resolve_model

        model_dir = resolve_model(cfg.model.path)  # the engine's tokenizer and chat template
    else:
        model_dir = policy_model_dir(cfg, out_dir)
    check_tasks(cfg, tasks, model_dir)
    rollout = eval_rollout(cfg)
    samples = cfg.eval.n_samples_per_prompt
    gyms_used = list(dict.fromkeys(t.gym for t in tasks))
    sim = simulator_identity(cfg) if any(gym_spec(g).needs_user_sim for g in gyms_used) else None
    protocol = {
        "max_turns": rollout.max_turns,
        "max_prompt_tokens": rollout.max_prompt_tokens,
        "max_response_tokens": rollout.max_response_tokens,
        "max_new_tokens_per_turn": rollout.max_new_tokens_per_turn,
        "reward_in_feedback": rollout.reward_in_feedback,
    }

    def gym_context(gym: str) -> dict[str, Any]:
        settings = dataclasses.asdict(config_for(gym, cfg.gyms, rollout.max_turns))
        return {"settings": settings, "simulator": sim if gym_spec(gym).needs_user_sim else None}

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cache = EpisodeCache(out_dir / CACHE)
    identity = await policy_identity(cfg, model_dir)
    context = {"policy": identity, "protocol": protocol}
    jobs = plan_jobs(tasks, samples, _sampling(cfg, rollout), cfg.run.seed, context, gym_context)
    cached_before = sum(job.key in cache for job in jobs)
    sim_counters: dict[str, float] | None = None  # this process's simulator calls (None: no simulator started)
    if cached_before == len(jobs):  # a finished evaluation: nothing to start
        records = await run_jobs(jobs, _NoPolicy(identity), cache, 1, 0)
    else:
        async with (
            user_simulator(cfg, gyms_used, out_dir / "engines") as user_sim,
            open_policy(cfg, rollout, identity, model_dir, user_sim, out_dir / "engines") as policy,
        ):
            concurrency = cfg.eval.max_concurrent_episodes or policy.concurrency
            records = await run_jobs(jobs, policy, cache, concurrency, cfg.eval.retries)
            if user_sim is not None:
                sim_counters = user_sim.metrics()
                log.info("user simulator: %s", ", ".join(f"{k} {v:g}" for k, v in sim_counters.items()))
    results = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "policy": {"name": _policy_name(cfg), **identity},
        "simulator": sim,
        # The client's counters over this process's episodes (training logs them as `user_sim/*`): calls, answered,
        # failures and retries by kind, tokens, latency. Episodes served from the cache made no call.
        "user_sim": sim_counters,
        "protocol": {
            **protocol,
            "samples": samples,
            "temperature": cfg.eval.temperature,
            "sources": list(cfg.gyms.test),
            "max_tasks": cfg.eval.max_tasks,
            "gym_settings": list(cfg.eval.gym_settings),
            "gyms": {g: gym_context(g)["settings"] for g in gyms_used},
        },
        "ci_method": CI_METHOD,
        **aggregate(records, samples),
        "seconds": round(time.perf_counter() - started, 2),
        "episodes_run": len(jobs) - cached_before,
        "episodes_cached": cached_before,
        "versions": versions(),
        "config": dataclasses.asdict(cfg),
    }
    write_outputs(out_dir, results, records)
    return results


def write_outputs(out_dir: Path, results: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """episodes.jsonl, results.json and report.md of a finished evaluation."""
    write_episodes_jsonl(out_dir / EPISODES, records)
    (out_dir / RESULTS).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / REPORT).write_text(report_markdown(results), encoding="utf-8")


def _policy_name(cfg: RootConfig) -> str:
    if cfg.eval.endpoint:
        return cfg.eval.api_model
    return cfg.eval.engine_url or cfg.model.path


def _sampling(cfg: RootConfig, rollout: RolloutConfig) -> SamplingParams:
    """Sampling of every turn (token policies add the chat template's stop tokens, which the key need not see:
    the template is part of the policy's identity)."""
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens_per_turn,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
    )


class _NoPolicy:
    """Stands in for the policy when every episode is cached (nothing is played)."""

    concurrency = 1

    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = identity

    async def run(self, task: Task, episode_id: str, sampling: SamplingParams) -> Any:
        raise AssertionError("a cached evaluation plays no episode")


def engine_url_key(cfg: RootConfig) -> str | None:
    """The key calls to `eval.engine_url` carry: `$rollout.api_key_env` when set (an engine started with
    `userrl serve --api-key-env` of that variable), else none."""
    return os.environ.get(cfg.rollout.api_key_env) or None
