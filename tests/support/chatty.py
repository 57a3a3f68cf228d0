"""A tiny random chat model that ends its turns, and tasks it can play: real-engine episodes stay multi-turn.

A random model rarely samples `<|im_end|>`, so every turn would run to its token limit. Scaling that token's
row of the output head makes its logit swing widely: at some positions it dominates and the turn ends. The
config names no EOS token, so the engine stops only where a request asks (the episode's turn stop tokens):
a request without stop tokens runs to its `max_new_tokens`, which tests use to keep one in flight.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gyms.function.rules import generate_function
from gyms.function.tasks import procedural_task
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.types import Episode, Message, Task


def make_chatty_model(
    out_dir: Path, eos_scale: float = 60.0, seed: int = 0, family: str = "llama", **overrides: object
) -> Path:
    """A tiny model of `family` (Llama by default) with the character tokenizer (tests.support.char_tokenizer)
    and a scaled `<|im_end|>` row."""
    from transformers import AutoTokenizer

    overrides.setdefault("max_position_embeddings", 4096)
    overrides.setdefault("eos_token_id", None)
    make_tiny_model(family, out_dir, seed=seed, tokenizer="char", **overrides)
    eos = AutoTokenizer.from_pretrained(out_dir).convert_tokens_to_ids("<|im_end|>")
    weights_file = out_dir / "model.safetensors"
    weights = load_file(weights_file)
    with torch.no_grad():
        weights["lm_head.weight"][eos] *= eos_scale
    save_file(weights, weights_file, metadata={"format": "pt"})
    return out_dir


def function_task(index: int, split: str = "train", **metadata: object) -> Task:
    """A generated FunctionGym task with a short ASCII prompt (the character tokenizer covers every character).

    Pass `reply_without_tool_call="action"` so that whatever a random model writes becomes a gym action.
    """
    generator = GymsConfig().function.generator
    task = procedural_task(generate_function(generator, split, index), generator)
    task.prompt = [Message("system", "Find the hidden function of a, b, c, d."), Message("user", "Begin.")]
    task.metadata.update(metadata)
    return task


def check_logprobs(episode: Episode, model: torch.nn.Module) -> None:
    """The rollout log-probs are the model's own log-probs of the sampled tokens in their context."""
    ids = torch.tensor([episode.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    token_logp = logp.gather(1, ids[0, 1:, None])[:, 0]
    positions = [i for i, m in enumerate(episode.loss_mask) if m]
    expected = token_logp[[p - 1 for p in positions]]
    actual = torch.tensor([episode.rollout_logprobs[p] for p in positions])
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=0)
