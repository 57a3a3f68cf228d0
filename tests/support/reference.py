"""A plain single-process torch reference for the actor: the HF model, the same policy loss, torch AdamW.

Independent of Megatron: episodes are run one at a time (no padding, no micro-batching), the loss is the
algorithm's loss over the whole batch, gradients come from autograd, the LR schedule is written out here.
"""

import math
from pathlib import Path

import torch

from userrl_megatron.algo.losses import LossInputs, compute_policy_loss
from userrl_megatron.config.schema import AlgoConfig, MegatronConfig
from userrl_megatron.megatron.packing import rows_tensor
from userrl_megatron.types import TrainBatch


def load_hf(model_dir: Path) -> torch.nn.Module:
    """The HF model in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def policy_loss(model: torch.nn.Module, batch: TrainBatch, algo: AlgoConfig) -> torch.Tensor:
    """The batch loss (normalised over the whole batch), with autograd through `model`."""
    width = max(len(t) for t in batch.token_ids)
    logprob_rows, entropy_rows = [], []
    for ids in batch.token_ids:
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        pad = width - len(ids)
        logprob_rows.append(torch.cat([chosen.new_zeros(1), chosen, chosen.new_zeros(pad)]))
        entropy_rows.append(torch.cat([entropy.new_zeros(1), entropy, entropy.new_zeros(pad)]))
    logprobs = torch.stack(logprob_rows)

    def rows(lists: list[list[float]] | None) -> torch.Tensor | None:
        return None if lists is None else rows_tensor(lists, width)

    old = rows(batch.old_logprobs)
    inputs = LossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach() if old is None else old,
        advantages=rows(batch.advantages),
        mask=rows(batch.loss_mask),
        ref_logprobs=rows(batch.ref_logprobs),
        rollout_logprobs=rows(batch.rollout_logprobs),
        entropy=torch.stack(entropy_rows),
    )
    return compute_policy_loss(inputs, algo).loss


def gradients(model_dir: Path, batch: TrainBatch, algo: AlgoConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradient of every HF parameter) for one batch."""
    model = load_hf(model_dir)
    loss = policy_loss(model, batch, algo)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def scheduled_lr(step: int, cfg: MegatronConfig) -> float:
    """The LR of optimizer step `step` (1-based): linear warmup from 0, then constant / linear / cosine."""
    if cfg.lr_warmup_steps and step <= cfg.lr_warmup_steps:
        return cfg.lr * step / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step > cfg.lr_decay_steps:
        return cfg.min_lr
    ratio = (step - cfg.lr_warmup_steps) / (cfg.lr_decay_steps - cfg.lr_warmup_steps)
    coeff = 1.0 - ratio if cfg.lr_schedule == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def train(model_dir: Path, batches: list[TrainBatch], algo: AlgoConfig, cfg: MegatronConfig) -> list[dict[str, float]]:
    """Loss, grad norm and LR of each step of AdamW (no weight decay on vectors) with global-norm clipping."""
    model = load_hf(model_dir)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
    )
    history = []
    for step, batch in enumerate(batches, start=1):
        opt.zero_grad()
        loss = policy_loss(model, batch, algo)
        loss.backward()
        if cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        lr = scheduled_lr(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        history.append({"loss": float(loss), "grad_norm": float(norm), "lr": lr})
    return history
