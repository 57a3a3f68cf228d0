"""The served model: a Hugging Face causal LM and its tokenizer, plus weight loading by HF parameter name.

Names are those of the HF checkpoint on disk (what SGLang and the trainer's weight sync use). Mixture-of-experts
models (Qwen3-MoE) hold their experts fused in memory under transformers 5: `mlp.experts.gate_up_proj`
[experts, 2 x width, hidden] and `mlp.experts.down_proj` [experts, hidden, width]; the checkpoint's per-expert
`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` are views into them (`_tensor_of`).

Routing capture (rollout routing replay): each MoE layer's router (`mlp.gate`, transformers' top-k router)
returns the expert ids it picked per token; a forward hook keeps them when a forward asks for them, so the
scheduler can return them as SGLang's `routed_experts`.
"""

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from userrl_megatron.attention_backends import SDPA_BACKENDS
from userrl_megatron.server import attention, onednn

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_LINEAR = ("onednn", "torch")  # what runs float32 linear layers on CPU (`rollout.embedded.cpu_linear`)
# Checkpoint entries that are buffers or derived values, skipped by SGLang's loaders as well.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
EXPERT_NAME = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class ModelSpec:
    """What the scheduler and the API layers need to know about the model."""

    path: str
    model_type: str
    architectures: list[str]
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    tie_word_embeddings: bool
    experts_per_token: int = 0  # top-k of the MoE router; 0 for a dense model


def _contiguous_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The LM head's input made contiguous: transformers hands it each row's last position, a strided view of the
    hidden states, on which a linear layer runs one matrix-vector product per row over the whole head (a batched
    matmul with the weight expanded) instead of one matmul: 11x the time for 102 rows of SmolLM2's head on CPU."""
    return (args[0].contiguous(), *args[1:])


class EngineModel:
    """A transformers model on one device, in eval mode, with its tokenizer (when the directory has one)."""

    def __init__(
        self,
        path: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        context_length: int = 0,
        cpu_linear: str = "onednn",
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if cpu_linear not in CPU_LINEAR:
            raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR)}, got {cpu_linear!r}")
        self.dtype = DTYPES[dtype]
        attention.register()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation=attention.NAME)
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method.
        self.model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
        # Where the weights landed ("cuda" -> "cuda:0"): every tensor and generator of the engine is made here.
        self.device = next(self.model.parameters()).device
        self.model.requires_grad_(False)
        # What runs the float32 linear layers on CPU: "onednn" where asked for and available, else torch's own.
        onednn_wanted = cpu_linear == "onednn" and self.device.type == "cpu" and self.dtype == torch.float32
        self.cpu_linear = "onednn" if onednn_wanted and onednn.available() else "torch"
        if self.cpu_linear == "onednn":
            onednn.route_linears(self.model)
        self.tokenizer: Any = None
        if (Path(path) / "tokenizer_config.json").is_file() or (Path(path) / "tokenizer.json").is_file():
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = self.model.config
        self.spec = ModelSpec(
            path=str(path),
            model_type=config.model_type,
            architectures=list(config.architectures or [type(self.model).__name__]),
            vocab_size=config.vocab_size,
            context_length=context_length or int(getattr(config, "max_position_embeddings", 0) or 4096),
            eos_token_ids=_eos_token_ids(self.model),
            num_layers=config.num_hidden_layers,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
        )
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # A release of the weights without a host copy: each parameter's shape while its memory is gone, and the
        # parameters not loaded since (garbage until a weight update or disk load fills them, as in SGLang).
        self._dropped: list[tuple[torch.nn.Parameter, torch.Size]] = []
        self.unloaded: list[str] = []
        self._loaded_since: set[str] = set()
        self._routers = _routers(self.model, self.spec.num_layers)
        self._routing: list[torch.Tensor] | None = None  # per MoE layer, top-k ids of the running forward
        for router in self._routers:
            router.register_forward_hook(self._keep_routing)
        head = self.model.get_output_embeddings()
        if head is not None:
            head.register_forward_pre_hook(_contiguous_input)

    @property
    def is_moe(self) -> bool:
        """Whether every layer has a top-k router whose choices `forward(..., routing=True)` can return."""
        return bool(self._routers)

    def _keep_routing(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._routing is not None:
            self._routing.append(output[2])

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        attention_mask: torch.Tensor | None = None,
        all_logits: bool = False,
        routing: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits of the last position of each row ([B, V]), or of every position ([B, L, V]).

        With `routing` (MoE models only) also the expert ids each layer's router chose for every input position,
        int32 [B, L, layers, top_k], in the router's order (highest probability first)."""
        if routing and not self.is_moe:
            raise ValueError("routed experts need a mixture-of-experts model")
        self._routing = [] if routing else None
        try:
            with sdpa_kernel(SDPA_BACKENDS):  # no cuDNN: a graph build per key length
                out = self.model(
                    input_ids=input_ids.to(self.device),
                    position_ids=position_ids.to(self.device),
                    attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=0 if all_logits else 1,
                )
            chosen = self._routing
        finally:
            self._routing = None
        logits = out.logits.float()
        logits = logits if all_logits else logits[:, -1, :]
        if chosen is None:
            return logits
        batch, length = input_ids.shape
        ids = torch.stack([c.reshape(batch, length, -1) for c in chosen], dim=2)
        return logits, ids.to("cpu", torch.int32)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the parameters of the same HF name; returns how many were loaded.

        With tied embeddings `lm_head.weight` is skipped (it is `model.embed_tokens.weight`), as SGLang does.
        Unknown names and shape mismatches raise: a silently ignored tensor would leave stale weights.
        """
        loaded = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if self._skipped(name):
                    continue
                param = self._tensor_of(name)
                if param is None:
                    raise KeyError(f"unknown parameter {name!r}")
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {tuple(param.shape)}")
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))
                loaded += 1
        return loaded

    def drop_weights(self) -> None:
        """Free every parameter's memory, keeping no copy (SGLang's release of "weights" without
        `--enable-weights-cpu-backup`); every parameter is unloaded until loaded again."""
        self._loaded_since = set()
        self.unloaded = self.missing_tensors(())  # from the shapes it has now
        self._dropped = [(p, p.shape) for p in self.model.parameters()]
        for param, _ in self._dropped:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def restore_memory(self) -> None:
        """Give the dropped parameters fresh memory of their shapes, filled with NaN: SGLang's resume maps new,
        uninitialised memory, and nothing of the old weights comes back."""
        for param, shape in self._dropped:
            param.data = torch.full(shape, float("nan"), dtype=param.dtype, device=param.device)
        self._dropped = []

    def mark_loaded(self, names: Iterable[str]) -> None:
        """Tensors `names` were written by a weight update: the parameters they fill are no longer unloaded."""
        if self.unloaded:
            self._loaded_since.update(names)
            self.unloaded = self.missing_tensors(self._loaded_since)

    def unloaded_error(self) -> str:
        """Why the model cannot serve ("" when it can): parameters dropped by a release and not loaded since."""
        if not self.unloaded:
            return ""
        shown = ", ".join(self.unloaded[:3]) + (", ..." if len(self.unloaded) > 3 else "")
        return (
            f"the weights were released without a host copy and {len(self.unloaded)} of the model's parameters have "
            f"not been loaded since ({shown}): push the weights (update_weights_from_*) or load them from disk first"
        )

    def _skipped(self, name: str) -> bool:
        """A tensor `load_weights` ignores: rotary caches, and the LM head when it is the tied embedding."""
        return name.endswith(SKIPPED_SUFFIXES) or (self.spec.tie_word_embeddings and name == "lm_head.weight")

    def receive_target(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor | None:
        """The memory an incoming `name` can be received into directly (its parameter, or one expert's view of
        the fused tensor): only where `load_weights` would make a plain copy of it (same dtype, shape and device,
        contiguous); None otherwise, also for names it would skip or refuse."""
        if self._skipped(name):
            return None
        target = self._tensor_of(name)
        if target is None or (target.dtype, tuple(target.shape), target.device) != (dtype, shape, device):
            return None
        return target if target.is_contiguous() else None

    def missing_tensors(self, names: Iterable[str]) -> list[str]:
        """The model's parameters a checkpoint with tensors `names` would leave as they are (for fused MoE
        experts: unless every expert's projections are named), in the model's order."""
        names = set(names)
        experts: set[tuple[str, str]] = set()  # (fused parameter name, expert index and projection)
        for name in names:
            if name not in self._params and (match := EXPERT_NAME.match(name)):
                fused = "down_proj" if match["proj"] == "down_proj" else "gate_up_proj"
                experts.add((f"{match['experts']}.{fused}", f"{match['e']}.{match['proj']}"))
        missing = []
        for name, param in self._params.items():
            if name in names or (self.spec.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
                projs = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
                if all((name, f"{e}.{proj}") in experts for e in range(param.shape[0]) for proj in projs):
                    continue
            missing.append(name)
        return missing

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any] | None:
        """The parameter as float32 nested lists, first `truncate_size` rows (SGLang's `/get_weights_by_name`);
        ValueError while it is unloaded (where SGLang would read back garbage)."""
        if self.spec.tie_word_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        param = self._tensor_of(name)
        if param is None:
            return None
        if self.unloaded and name not in self._loaded_since:
            raise ValueError(f"{name} holds no weights: {self.unloaded_error()}")
        return param.detach()[:truncate_size].to("cpu", torch.float32).numpy().tolist()  # rows first: no full copy

    def _tensor_of(self, name: str) -> torch.Tensor | None:
        """The parameter of a checkpoint name, or for one expert's projection the view of it inside the fused
        expert tensors; None if the model has no such tensor."""
        param = self._params.get(name)
        match = EXPERT_NAME.match(name) if param is None else None
        if match is None:
            return param
        e, proj = int(match["e"]), match["proj"]
        fused = self._params.get(f"{match['experts']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
            return None
        if proj == "down_proj":
            return fused[e]
        width = fused.shape[1] // 2
        return fused[e, :width] if proj == "gate_proj" else fused[e, width:]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (the model's tokenizer, special tokens as the tokenizer adds them)."""
        if self.tokenizer is None:
            raise ValueError("The server has no tokenizer; send input_ids instead of text.")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, or "" without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _routers(model: torch.nn.Module, num_layers: int) -> list[torch.nn.Module]:
    """The top-k router of every decoder layer in layer order, or [] unless every layer has one (the layout
    SGLang's capture assumes: one row of ids per layer)."""
    routers = {}
    for name, module in model.named_modules():
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate", name)
        if match and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            routers[int(match[1])] = module
    return [routers[i] for i in range(num_layers)] if len(routers) == num_layers else []


def _eos_token_ids(model: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))
