"""The embedded engine's release of its weights is as strict as SGLang's, never more lenient.

SGLang 0.5.23 loads the weights into a memory-saver region whose host backup is off unless
`--enable-weights-cpu-backup` (`model_executor/model_runner_components/load_model_utils.py:307`). Releasing
"weights" pauses that region (`managers/scheduler_components/weight_updater.py:368-374`) and resuming maps fresh
memory without reloading anything (`weight_updater.py:395-403`): after a resume the model computes with whatever
that memory holds, silently, until a weight update writes it. The embedded engine drops its weights on such a
release, gives NaN-filled memory back on resume, and refuses generation and read-back until every parameter has been
written again: where SGLang goes silently wrong, it fails loudly."""

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.server.local import LocalEngine
from userrl_megatron.server.scheduler import Request
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(request.param, tmp_path_factory.mktemp("release") / "tiny", num_hidden_layers=2)


def launch(tiny_dir: Path, weight_dirs: list[str], backup: bool = False) -> LocalEngine:
    cfg = EmbeddedServerConfig(device="cpu", weight_dirs=weight_dirs, enable_weights_cpu_backup=backup)
    return LocalEngine.launch(str(tiny_dir), cfg)


async def load_from(engine: LocalEngine, folder: Path, allow_partial: bool = False) -> tuple[bool, str]:
    await engine.begin_weight_update()
    try:
        return await engine.core.update_weights_from_disk(str(folder), allow_partial=allow_partial)
    finally:
        await engine.end_weight_update()


def test_released_weights_come_back_empty_and_generation_waits_for_every_parameter(
    tiny_dir: Path, tmp_path: Path
) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    state = load_file(tiny_dir / "model.safetensors")
    (tmp_path / "part").mkdir()
    save_file({n: t for n, t in state.items() if ".layers.0." in n}, tmp_path / "part" / "model.safetensors")
    engine = launch(tiny_dir, [str(tmp_path), str(tiny_dir)])
    params = list(engine.core.model.model.parameters())
    total = len(engine.core.model.missing_tensors(()))

    async def scenario() -> None:
        await engine.release_memory(["weights", "kv_cache"])
        assert all(p.numel() == 0 for p in params)  # nothing kept: no host copy
        ok, message = await load_from(engine, tiny_dir)
        assert (ok, message) == (
            False,
            "Failed to update weights: the weights' memory is released: resume it (/resume_memory_occupation) "
            "before a weight update. Rolling back to original weights.",
        )
        await engine.resume_memory(["weights", "kv_cache"])
        assert all(torch.isnan(p).all() for p in params)  # fresh memory: none of the old weights
        with pytest.raises(
            EngineError, match=rf"^Cannot generate: the weights were released without a host copy and {total} of"
        ):
            await engine.generate(PROMPT, GREEDY)
        with pytest.raises(ValueError, match=r"^model\.norm\.weight holds no weights: the weights were released"):
            await engine.core.get_weights_by_name("model.norm.weight")
        assert await load_from(engine, tmp_path / "part", allow_partial=True) == (
            True,
            "Succeeded to update model weights.",
        )
        left = engine.core.model.unloaded
        assert 0 < len(left) < total and not any(".layers.0." in n for n in left)
        with pytest.raises(EngineError, match=rf"^Cannot generate: .* {len(left)} of the model's parameters"):
            await engine.generate(PROMPT, GREEDY)
        assert await load_from(engine, tiny_dir) == (True, "Succeeded to update model weights.")
        assert engine.core.model.unloaded == []

    try:
        asyncio.run(scenario())
        assert asyncio.run(engine.generate(PROMPT, GREEDY)).output_ids == hf_greedy(hf, PROMPT, GREEDY.max_new_tokens)
    finally:
        engine.close()


def test_requests_queued_before_an_unrefilled_resume_are_refused(tiny_dir: Path) -> None:
    """A request that waits while the engine is released would run on the fresh memory once it resumes."""
    engine = launch(tiny_dir, [])

    async def scenario() -> Request:
        await engine.release_memory(["weights"])
        waiting = asyncio.ensure_future(engine.core.generate(Request(list(PROMPT), _spec(engine))))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # held while released
        await engine.resume_memory(["weights"])
        return await waiting

    try:
        request = asyncio.run(scenario())
    finally:
        engine.close()
    assert request.output_ids == [] and request.finish_reason is not None
    assert request.finish_reason["type"] == "abort"
    assert request.finish_reason["message"].startswith("Cannot generate: the weights were released without a host")


def test_a_host_copy_keeps_the_weights(tiny_dir: Path) -> None:
    """`enable_weights_cpu_backup` (forced on for colocated runs without weight sync): the weights survive."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    engine = launch(tiny_dir, [], backup=True)

    async def scenario() -> list[int]:
        await engine.release_memory(["weights"])
        await engine.resume_memory(["weights"])
        return (await engine.generate(PROMPT, GREEDY)).output_ids

    try:
        assert asyncio.run(scenario()) == hf_greedy(hf, PROMPT, GREEDY.max_new_tokens)
    finally:
        engine.close()


def _spec(engine: LocalEngine):  # type: ignore[no-untyped-def]
    from userrl_megatron.server.sampling import parse_sampling_params

    return parse_sampling_params(GREEDY.to_dict(), engine.core.model.spec.vocab_size)
