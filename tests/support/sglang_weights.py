"""The weights an engine holds, checked exactly for every model class SGLang serves: by SGLang's weights checker,
where `/get_weights_by_name` is refused.

SGLang 0.5.23 reads a weight back by name only for the model classes that define `get_weights_by_name` (llama, opt,
granite, exaone4, embedding_gemma2): for the others, Qwen3 and Qwen3-MoE among them, the call fails inside
`model_executor/model_runner_components/weight_exporter.py:169-188` and the route answers 400 "Get parameter by
name failed" (`entrypoints/http_server.py:1559-1568`). Its weights checker answers for every class:
`POST /weights_checker {"action": "checksum"}` (`http_server.py:1599-1619`, `managers/tokenizer_control_mixin.py:
890-910`) returns, per rank, a checksum of every parameter and buffer of the served model under SGLang's own names,
rotary caches left out (`utils/weight_checker.py:206-252`, `_model_state`; :60-80, the skipped names); each is
`tensor_hash` of the tensor as stored, on CPU the first 8 bytes of the sha256 of its bytes, big-endian, as 16 hex
digits (`weight_checker.py:254-255`, `managers/mm_utils.py:899-928`).

The expected checksums are computed here from the state the engine should hold, under the checkpoint's (Hugging
Face) names, laid out as SGLang's loaders fill its fused parameters:
- `self_attn.qkv_proj` = cat(q_proj, k_proj, v_proj) and `mlp.gate_up_proj` = cat(gate_proj, up_proj), on dim 0
  (`models/qwen3.py:687-694` and `models/qwen3_moe.py:1160-1167`, stacked_params_mapping; `layers/linear.py:652`
  MergedColumnParallelLinear and :1075 QKVParallelLinear concatenate along the output dim);
- Qwen3-MoE's `mlp.experts.w13_weight` [E, 2I, H] = per expert cat(gate_proj, up_proj) and `mlp.experts.w2_weight`
  [E, H, I] = down_proj (`qwen3_moe.py:1169-1174` and `layers/moe/fused_moe_triton/layer.py:1797-1822`,
  make_expert_params_mapping: gate is w1, up w3, down w2; `layer.py:788-879` _load_w13: w1 at row 0, w3 at row I);
- `model.embed_tokens` and `lm_head` padded with zero rows to a multiple of 64 (`layers/vocab_parallel_embedding.py:
  48` DEFAULT_VOCAB_PADDING_SIZE, :446-447 the copy and the zero fill);
- every other tensor under its checkpoint name (a tied `lm_head` is the embedding's parameter, counted once).

It assumes one TP rank, unquantized weights and a CPU without AMX: on one with AMX SGLang repacks linear and expert
weights after loading (`layers/quantization/unquant.py:568-570, 872-874`), and the checksums are of the packed layout.
"""

import hashlib
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch

from tests.support.servers import http_call

VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE
VOCAB_SIZED = ("model.embed_tokens.weight", "lm_head.weight")
# Checkpoint names SGLang loads into a fused parameter: (name pattern, fused name, the shards in their order).
STACKED = re.compile(r"^(?P<pre>.+)\.(?P<shard>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<kind>weight|bias)$")
FUSED_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj"}  # fmt: skip
SHARD_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def sglang_name(name: str) -> str:
    """The SGLang parameter that holds checkpoint tensor `name` (whole or as one shard)."""
    expert = EXPERT.match(name)
    if expert is not None:
        return f"{expert['experts']}.{'w2' if expert['proj'] == 'down_proj' else 'w13'}_weight"
    stacked = STACKED.match(name)
    if stacked is not None:
        return f"{stacked['pre']}.{FUSED_OF[stacked['shard']]}.{stacked['kind']}"
    return name


def sglang_params(state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`state` (checkpoint name -> tensor: every tensor of the checkpoint) as SGLang's Llama, Qwen3 and Qwen3-MoE
    classes hold it in `dtype`, under SGLang's parameter names."""
    shards: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    params: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu", dtype)
        if (expert := EXPERT.match(name)) is not None:
            experts[expert["experts"]][int(expert["e"]), expert["proj"]] = tensor
        elif (stacked := STACKED.match(name)) is not None:
            shards[sglang_name(name)][stacked["shard"]] = tensor
        elif name in VOCAB_SIZED:
            pad = -tensor.shape[0] % VOCAB_PADDING
            params[name] = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        else:
            params[name] = tensor
    for fused, parts in shards.items():
        order = SHARD_ORDER[fused.rsplit(".", 2)[-2]]
        if set(parts) != set(order):
            raise ValueError(f"{fused}: the state holds {sorted(parts)} of {order}")
        params[fused] = torch.cat([parts[shard] for shard in order])
    for prefix, per_expert in experts.items():
        count = 1 + max(e for e, _ in per_expert)
        if len(per_expert) != 3 * count:
            raise ValueError(f"{prefix}: the state holds {len(per_expert)} of {count} experts' 3 projections")
        e_range = range(count)
        params[f"{prefix}.w13_weight"] = torch.stack(
            [torch.cat([per_expert[e, "gate_proj"], per_expert[e, "up_proj"]]) for e in e_range]
        )
        params[f"{prefix}.w2_weight"] = torch.stack([per_expert[e, "down_proj"] for e in e_range])
    return params


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's checksum of a CPU tensor: the first 8 bytes of the sha256 of its bytes, as 16 hex digits."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def engine_checksums(url: str) -> dict[str, str]:
    """The checksum of every parameter of the SGLang server at `url` (one TP rank), by its weights checker."""
    status, body = http_call(url, "/weights_checker", {"action": "checksum"})
    if status != 200 or not isinstance(body, dict) or not body.get("success"):
        raise RuntimeError(f"{url}/weights_checker answered {status}: {body}")
    (rank,) = body["ranks"]
    return dict(rank["checksums"])


def differing(url: str, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The SGLang parameters of the server at `url` whose checksum is not that of `state` (every tensor of the
    checkpoint, by checkpoint name), and those only one side has."""
    expected = {name: tensor_checksum(t) for name, t in sglang_params(state).items()}
    held = engine_checksums(url)
    return sorted(name for name in expected.keys() | held.keys() if expected.get(name) != held.get(name))


def sglang_names(names: Iterable[str]) -> set[str]:
    """The SGLang parameters holding checkpoint tensors `names`."""
    return {sglang_name(n) for n in names}


def hf_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The tensor of checkpoint name `name` in a transformers model, as a view (copying into it changes the model):
    its parameter, or for one expert's projection the slice of the fused experts transformers 5 holds
    (`mlp.experts.gate_up_proj` [E, 2I, H], per expert cat(gate, up); `mlp.experts.down_proj` [E, H, I])."""
    expert = EXPERT.match(name)
    if expert is None:
        return model.get_parameter(name)
    e = int(expert["e"])
    if expert["proj"] == "down_proj":
        return model.get_parameter(f"{expert['experts']}.down_proj")[e]
    fused = model.get_parameter(f"{expert['experts']}.gate_up_proj")[e]
    half = fused.shape[0] // 2
    return fused[:half] if expert["proj"] == "gate_proj" else fused[half:]


def checkpoint_state(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The transformers model's tensors under checkpoint names `names`, in sorted order (views, detached)."""
    return {name: hf_tensor(model, name).detach() for name in sorted(names)}
