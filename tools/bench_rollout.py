"""Multi-turn rollout throughput of the embedded engine, against sequential `transformers.generate`, in one run.

For each model, the EpisodeRunner plays FunctionGym episodes (every reply is sent to the gym as an action, so
episodes stay multi-turn whatever the model writes) on an in-process embedded engine (`LocalEngine`) at each
concurrency; then the same model generates each first-turn prompt alone with `model.generate`. Reported:
generated tokens/s and episodes/s per concurrency, the speed-up of each concurrency over concurrency 1 (target
at 32: >= 4x), and the engine at concurrency 1 against `generate`.

    python tools/bench_rollout.py                                # smollm2 and tiny, concurrency 1, 8, 32
    python tools/bench_rollout.py --models tiny --concurrency 1,8 --quick --out bench.json
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_SPEEDUP_AT_32 = 4.0


def _model_dir(name: str, scratch: Path) -> Path:
    from userrl_megatron.model_store import resolve_model

    if name == "smollm2":
        return resolve_model("smollm2-135m-instruct")
    if name == "tiny":
        from tests.support.chatty import make_chatty_model

        return make_chatty_model(scratch / "tiny")
    raise SystemExit(f"unknown model {name!r}: use smollm2 or tiny")


async def _rollout(engine: Any, runner: Any, tasks: list[Any], concurrency: int) -> dict[str, float]:
    steps = engine.core.scheduler.decode_steps
    started = time.perf_counter()
    groups = await runner.run_groups(tasks, 1, lambda _: engine, concurrency=concurrency)
    seconds = time.perf_counter() - started
    episodes = [e for g in groups for e in g.episodes]
    generated = sum(sum(e.loss_mask) for e in episodes)
    failed = [e.finish_reason for e in episodes if e.finish_reason in ("engine_error", "gym_error")]
    if failed:
        raise SystemExit(f"benchmark episodes failed: {failed}")
    return {
        "episodes": len(episodes),
        "turns": sum(len(e.turns) for e in episodes),
        "generated_tokens": generated,
        "seconds": round(seconds, 6),
        "tokens_per_s": round(generated / seconds, 2),
        "episodes_per_s": round(len(episodes) / seconds, 4),
        "decode_forwards": engine.core.scheduler.decode_steps - steps,
    }


def _hf_sequential(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """`model.generate` on one prompt at a time (sampling, KV cache), as a plain transformers loop would."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    generated, started = 0, time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=eos if eos is not None else 0,
            )
            generated += out.shape[1] - len(prompt)
    seconds = time.perf_counter() - started
    return {"prompts": len(prompts), "generated_tokens": generated, "seconds": round(seconds, 6),
            "tokens_per_s": round(generated / seconds, 2)}  # fmt: skip


def bench_model(name: str, concurrency: list[int], episodes_per_slot: int, args: argparse.Namespace) -> dict:
    from tests.support.chatty import function_task
    from userrl_megatron.config.schema import EmbeddedServerConfig, GymsConfig, RolloutConfig
    from userrl_megatron.rollout.chat import ChatTemplate
    from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory
    from userrl_megatron.server.local import LocalEngine

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _model_dir(name, Path(scratch))
        chat = ChatTemplate.from_pretrained(model_dir, "tags")
        cfg = RolloutConfig(
            max_turns=args.max_turns,
            max_new_tokens_per_turn=args.max_new_tokens,
            max_response_tokens=args.max_turns * (args.max_new_tokens + 64),
            max_prompt_tokens=1024,
            temperature=1.0,
        )
        runner = EpisodeRunner(cfg, chat, gym_factory(GymsConfig(), cfg.max_turns))
        engine = LocalEngine.launch(str(model_dir), EmbeddedServerConfig(max_running_requests=max(concurrency)))
        results: dict[str, Any] = {"model": name, "concurrency": {}}
        try:
            asyncio.run(_rollout(engine, runner, [function_task(10_000, reply_without_tool_call="action")], 1))
            for c in concurrency:
                count = max(c * episodes_per_slot, 4)  # at least 4 episodes per measurement
                tasks = [function_task(i, reply_without_tool_call="action") for i in range(count)]
                results["concurrency"][str(c)] = asyncio.run(_rollout(engine, runner, tasks, c))
                print(f"{name} concurrency {c}: {results['concurrency'][str(c)]}", flush=True)
        finally:
            engine.close()
        prompts = [chat.prompt_ids(*chat.present(t.prompt, t.tools)) for t in [function_task(i) for i in range(4)]]
        results["hf_generate"] = _hf_sequential(model_dir, prompts[: 2 if args.quick else 4], args.max_new_tokens)
        print(f"{name} transformers.generate: {results['hf_generate']}", flush=True)
    by_c = results["concurrency"]
    base = by_c[str(concurrency[0])]["tokens_per_s"]
    results["speedup_over_first"] = {c: round(r["tokens_per_s"] / base, 2) for c, r in by_c.items()}
    results["engine_c1_over_hf"] = round(base / results["hf_generate"]["tokens_per_s"], 2) if "1" in by_c else None
    if "32" in by_c and concurrency[0] == 1:
        results["target_speedup_at_32"] = TARGET_SPEEDUP_AT_32
        results["meets_target"] = results["speedup_over_first"]["32"] >= TARGET_SPEEDUP_AT_32
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,tiny", help="comma-separated: smollm2, tiny")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated episode concurrencies")
    p.add_argument("--episodes-per-slot", type=int, default=2, help="episodes per concurrency slot (at least 4)")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation limit of one turn")
    p.add_argument("--quick", action="store_true", help="one episode per slot (smoke run)")
    p.add_argument("--out", default="", help="write the JSON here too")
    args = p.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    per_slot = 1 if args.quick else args.episodes_per_slot
    report = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": _torch_threads()},
        "settings": {"max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "episodes_per_slot": per_slot},
        "models": [bench_model(m, concurrency, per_slot, args) for m in args.models.split(",")],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
