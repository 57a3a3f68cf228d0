"""Multi-process test harness for the Megatron actor (gloo on CPU), and reference values from `transformers`.

Tests call `spawn(fn, world_size, *args)`: `fn(rank, world_size, port, *args)` runs in fresh processes
(importable, module-level functions only) and returns plain Python data, which the test then asserts on.
Inside a rank, `init_world(rank, world_size, port, tp=..., pp=...)` sets up torch.distributed and
Megatron's groups; calling it again with other sizes re-lays the same processes out (cheaper than a new
spawn: each fresh process pays ~4 s of imports).
"""

import dataclasses
import random
from pathlib import Path
from typing import Any

import torch

from userrl_megatron.config.schema import AlgoConfig, MegatronConfig, ModelConfig
from userrl_megatron.megatron.launch import run_local
from userrl_megatron.types import TrainBatch

DEFAULT_TIMEOUT_S = 1800.0  # a bound on ranks that never report (a hang), not on how fast they compute


def spawn(fn: Any, world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run `fn(rank, world_size, port, *args)` on `world_size` gloo ranks; returns each rank's result."""
    return run_local(fn, world_size, *args, timeout_s=timeout_s)


def megatron_config(**overrides: Any) -> MegatronConfig:
    """A MegatronConfig for tests: fp32-friendly optimizer defaults, overridable by keyword (short names ok)."""
    short = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size"}
    short["vpp"] = "virtual_pipeline_model_parallel_size"
    fields = {short.get(k, k): v for k, v in overrides.items()}
    fields.setdefault("micro_batch_tokens", 64)
    fields.setdefault("lr", 1e-3)
    # Adam's first steps move each parameter by about ±lr whatever its gradient: eps above fp32 gradient noise
    # keeps components that are pure noise (different under each layout) from taking full steps.
    fields.setdefault("adam_eps", 1e-6)
    return MegatronConfig(**fields)


def init_world(rank: int, world_size: int, port: int, cfg: MegatronConfig) -> Any:
    """Initialise (or re-initialise with another layout) torch.distributed and Megatron's groups."""
    from userrl_megatron.megatron import parallel

    return parallel.initialize(cfg, rank=rank, world_size=world_size, master_port=port)


def build_actor(model_dir: Path, cfg: MegatronConfig, algo: AlgoConfig | None = None, seed: int = 0) -> Any:
    """A MegatronActor on the HF model in `model_dir` (fp32)."""
    from userrl_megatron.megatron.actor import MegatronActor

    return MegatronActor(ModelConfig(path=str(model_dir)), cfg, algo or AlgoConfig(), seed)


def random_sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token sequences of the given lengths with ids uniform in [0, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def random_batch(vocab: int, lengths: list[int], seed: int = 0, prompt: int = 3) -> TrainBatch:
    """A TrainBatch: random tokens, the first `prompt` tokens untrained, random advantages and old log-probs."""
    rng = random.Random(seed + 1)
    ids = random_sequences(vocab, lengths, seed)
    mask = [[0] * min(prompt, n) + [int(rng.random() < 0.8) for _ in range(n - prompt)] for n in lengths]
    adv = [[rng.gauss(0, 1) if m else 0.0 for m in row] for row in mask]
    old = [[0.0] + [-5.0 + rng.gauss(0, 0.3) for _ in range(n - 1)] for n in lengths]
    return TrainBatch(token_ids=ids, loss_mask=mask, advantages=adv, old_logprobs=old)


def hf_logprobs(model_dir: Path, seqs: list[list[int]], entropy: bool = False) -> Any:
    """Reference per-token log-probs (position 0 = 0.0) from the `transformers` model, fp32, one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, ent = [], []
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor([s])).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = logp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            out.append([0.0, *chosen.tolist()])
            ent.append([0.0, *(-(logp.exp() * logp).sum(-1)).tolist()])
    return (out, ent) if entropy else out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over ragged lists of equal shapes (inf if the shapes differ)."""
    if [len(x) for x in a] != [len(x) for x in b]:
        return float("inf")
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def replace(cfg: MegatronConfig, **changes: Any) -> MegatronConfig:
    """`dataclasses.replace` with the short names of `megatron_config`."""
    return megatron_config(**{**dataclasses.asdict(cfg), **changes})
