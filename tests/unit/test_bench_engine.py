"""tools/bench_engine.py's figures: percentiles, a level's summary, the embedded / SGLang ratios, the matmul rate
and share, the KV budget, the decode-step breakdown of a profile, and the arguments."""

from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.tools import load_tool
from userrl_megatron.convert.arch import Architecture

# SmolLM2-135M-Instruct's config.json (the parts Architecture reads): 134,515,008 parameters, as its weights hold.
SMOLLM2 = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5, "head_dim": 64, "max_position_embeddings": 8192,
}  # fmt: skip


bench = load_tool("bench_engine")


def test_percentiles_interpolate_between_ranks() -> None:
    assert bench.percentile([3.0, 1.0, 4.0, 2.0], 0.5) == 2.5
    eleven = [float(v) for v in range(10, -1, -1)]
    assert (bench.percentile(eleven, 0.5), bench.percentile(eleven, 0.9)) == (5.0, 9.0)
    assert (bench.percentile([7.0], 0.9), bench.percentile(eleven, 0.0), bench.percentile(eleven, 1.0)) == (7, 0, 10)
    with pytest.raises(ValueError):
        bench.percentile([], 0.5)


def test_level_summary_counts_tokens_ttft_and_short_turns() -> None:
    ttfts = [0.5, 1.5, 1.0, 3.0, 2.0, 4.0]
    turns = [bench.Turn(40 if i == 2 else 48, t, 10 * i) for i, t in enumerate(ttfts)]
    level = bench.level_summary(concurrency=2, episodes=2, turns=turns, seconds=2.0, max_new_tokens=48)
    assert level == {
        "concurrency": 2,
        "episodes": 2,
        "requests": 6,
        "tokens": 280,
        "prefilled_tokens": 150,
        "seconds": 2.0,
        "tokens_per_s": 140.0,
        "ttft_s": {"mean": 2.0, "p50": 1.75, "p90": 3.5},
        "short_turns": 1,
    }


def test_matmul_rate_parameters_and_share() -> None:
    assert bench.matmul_rate(2048, 4, 0.5) == 137_438_953_472.0  # 2 x 2048^3 x 4 FLOPs in half a second
    arch = Architecture.from_hf_config(SMOLLM2)
    tied = bench.matmul_parameters(arch.num_active_parameters, arch.vocab_size, arch.hidden_size, True)
    assert tied == arch.num_parameters == 134_515_008  # the tied embedding counts once, as the LM head
    assert bench.matmul_parameters(1000, 10, 4, tied_embeddings=False) == 960  # an untied input embedding: a lookup
    # 200 tokens/s x 2 x 134,515,008 FLOPs = 53.8 GFLOP/s of a 268.0 GFLOP/s matmul rate
    assert bench.matmul_share(200.0, 2.0 * tied, 2.0 * 134_515_008 * 1000) == 0.2


def test_ceiling_multiplies_the_models_own_matrices() -> None:
    shapes = bench.linear_shapes(Architecture.from_hf_config(SMOLLM2))
    assert len(shapes) == 30 * 7 + 1 and shapes[:7] == [
        (576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)
    ] and shapes[-1] == (49152, 576)  # fmt: skip
    norms = 30 * 2 * 576 + 576  # two RMSNorm weights a layer and the final one: the only parameters left out
    assert sum(o * i for o, i in shapes) == 134_515_008 - norms
    moe = SMOLLM2 | {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    assert bench.linear_shapes(Architecture.from_hf_config(moe)) is None

    ceiling = bench.measure_ceiling([(64, 32), (32, 64)], rows=4, threads=1, trials=2)
    assert ceiling["rows"] == 4 and set(ceiling["kernels_seconds"]) <= {"torch.mm", "onednn"}
    assert "torch.mm" in ceiling["kernels_seconds"]
    fastest = min(ceiling["kernels_seconds"].values())
    assert ceiling["flops_per_s"] == 2.0 * 4 * (64 * 32 + 32 * 64) / fastest


def test_kv_budget_holds_twice_the_largest_levels_episodes() -> None:
    assert bench.kv_tokens(128, 254) == 65_024
    assert bench.kv_tokens(8, 254) == bench.MIN_KV_TOKENS == 16_384


def level(backend: str, threads: int, concurrency: int, tokens_per_s: float, ttft: tuple[float, ...]) -> dict[str, Any]:
    return {"backend": backend, "threads": threads, "concurrency": concurrency, "tokens_per_s": tokens_per_s,
            "tokens": 100, "prefilled_tokens": 60, "seconds": 2.0,
            "ttft_s": dict(zip(("mean", "p50", "p90"), ttft, strict=True))}  # fmt: skip


def test_peer_ratios_shares_and_targets() -> None:
    levels = [
        level("embedded", 0, 1, 25.0, (0.25, 0.25, 0.5)),
        level("embedded", 0, 32, 200.0, (1.0, 0.75, 2.0)),
        level("embedded", 0, 128, 240.0, (4.0, 3.0, 6.0)),
        level("sglang", 0, 1, 20.0, (0.5, 0.5, 0.5)),
        level("sglang", 0, 32, 250.0, (2.0, 1.5, 2.0)),
    ]
    bench.annotate(levels, {0: 400.0}, flops_per_token=1.0)
    assert [r["ratio_to_first"] for r in levels] == [1.0, 8.0, 9.6, 1.0, 12.5]
    assert [r["matmul_share"] for r in levels] == [0.0625, 0.5, 0.6, 0.05, 0.625]
    # 100 generated and 60 prefilled tokens in 2 s at 1 FLOP a token, of 400 FLOP/s
    assert [r["work_share"] for r in levels] == [0.2] * 5
    peers = bench.peer_rows(levels)
    assert peers == [  # concurrency 128 ran on the embedded engine only
        {"threads": 0, "concurrency": 1, "tokens_per_s_ratio": 1.25, "ttft_mean_ratio": 0.5, "ttft_p50_ratio": 0.5,
         "ttft_p90_ratio": 1.0, "embedded_not_slower": True},
        {"threads": 0, "concurrency": 32, "tokens_per_s_ratio": 0.8, "ttft_mean_ratio": 0.5, "ttft_p50_ratio": 0.5,
         "ttft_p90_ratio": 1.0, "embedded_not_slower": False},
    ]  # fmt: skip
    assert bench.targets(levels, peers) == {
        "embedded_never_slower": False,
        "share_target": 0.7,
        "share_at_concurrency": 32,
        "matmul_share": {"embedded": {"0": 0.5}, "sglang": {"0": 0.625}},
    }
    assert bench.targets(levels[:3], [])["embedded_never_slower"] is None  # nothing to compare


def event(name: str, self_us: float, *children: SimpleNamespace) -> SimpleNamespace:
    node = SimpleNamespace(name=name, self_cpu_time_total=self_us, cpu_children=list(children), cpu_parent=None)
    for child in children:
        child.cpu_parent = node
    return node


def test_step_breakdown_attributes_self_times_to_phases_and_kinds() -> None:
    forward = event(
        "decode/forward",
        1000.0,
        event("aten::linear", 1000.0, event("aten::addmm", 6000.0)),
        event("aten::_scaled_dot_product_flash_attention_for_cpu", 3000.0),
        event("aten::mul", 400.0),
    )
    sample = event("decode/sample", 300.0, event("aten::sort", 700.0))
    steps = [event("decode/step", 500.0, forward, sample, event("aten::copy_", 900.0)) for _ in range(2)]
    assert bench.step_breakdown(steps + steps[0].cpu_children, steps=2) == {  # nested events are not counted twice
        "forward/attention": 3.0,
        "forward/matmul": 7.0,
        "forward/ops": 0.4,
        "forward/python": 1.0,
        "sample/ops": 0.7,
        "sample/python": 0.3,
        "step/ops": 0.9,
        "step/python": 0.5,
    }


def test_arguments() -> None:
    args = bench.parse_args([])
    assert (args.backend, args.concurrency, args.threads, args.turns, args.max_new_tokens) == (
        ["embedded"],
        [1, 32],
        [0],
        3,
        48,
    )
    args = bench.parse_args(["--backend", "embedded", "sglang", "--concurrency", "1", "8", "32", "128"])
    assert (args.backend, args.concurrency, args.profile_decode) == (["embedded", "sglang"], [1, 8, 32, 128], False)
    assert bench.parse_args(["--threads", "1", "2"]).threads == [1, 2]
    for bad in (["--backend", "vllm"], ["--concurrency", "0"], ["--max-new-tokens", "0"], ["--threads", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_structured_levels_are_compared_with_the_free_ones() -> None:
    def level(backend: str, concurrency: int, rate: float) -> dict[str, Any]:
        return {"backend": backend, "threads": 0, "concurrency": concurrency, "tokens_per_s": rate}

    free = [level("embedded", 1, 20.0), level("embedded", 32, 100.0), level("sglang", 32, 50.0)]
    schema = [level("embedded", 1, 18.0), level("embedded", 32, 70.0), level("sglang", 32, 45.0)]
    rows = bench.structured_rows(free, schema)
    assert [(r["backend"], r["concurrency"], r["tokens_per_s_ratio"], r["meets_target"]) for r in rows] == [
        ("embedded", 1, 0.9, True),
        ("embedded", 32, 0.7, False),
        ("sglang", 32, 0.9, True),
    ]
    assert bench.parse_args(["--structured"]).structured and not bench.parse_args([]).structured
