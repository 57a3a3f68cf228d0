"""A format warm-up for tiny test policies: short supervised training on chats whose assistant turns are one
random letter followed by end-of-turn. Afterwards the policy answers in the right format but ignores what
the user asks for, so reward is at chance level and only RL can teach it which letter to say.
"""

import random
from pathlib import Path

import torch


def warm_start(model_dir: Path, letters: str = "abcd", steps: int = 150, seed: int = 0, lr: float = 3e-3) -> Path:
    """Fine-tune the model in `model_dir` in place (plain torch + transformers, no project code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids, labels = _chat(tok, rng, letters)
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def _chat(tok: object, rng: random.Random, letters: str) -> tuple[list[int], list[int]]:
    """One 3-turn echo-style chat; labels are -100 except on the assistant letters and their end-of-turn."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": "Reply with the letter the user asks for, and nothing else."}]
    ids: list[int] = []
    labels: list[int] = []
    for _ in range(3):
        messages.append({"role": "user", "content": f"Say {rng.choice(letters)}."})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        reply = rng.choice(letters)
        answer = [*tok.encode(reply, add_special_tokens=False), end]
        new = prompt[len(ids) :]
        ids += new + answer
        labels += [-100] * len(new) + answer
        messages.append({"role": "assistant", "content": reply})
        ids.append(tok.convert_tokens_to_ids("\n"))  # the template's newline after <|im_end|>
        labels.append(-100)
    return ids, labels
