"""Reference results from plain `transformers` for engine tests: greedy generation and forward-pass log-probs."""

import torch


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`generate` with greedy decoding, stopping at the model's EOS like the engine; only the new tokens."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / temperature) of each output token, from one forward pass over prompt + output."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=device)).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]
