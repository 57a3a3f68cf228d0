"""What `userrl eval` evaluates: a policy that plays one episode of a task, and the identity that names it.

`TokenPolicy` plays through the token-level `EpisodeRunner` on any engine handle (the rollout pool's sessions,
or one already-running engine's native API); `userrl_megatron.eval.api_policy.ApiPolicy` plays through an
OpenAI-compatible chat endpoint. Each carries an `identity` (a JSON-able dict) that goes into results.json and
into every cache key, so that results of different weights or endpoints never mix.
"""

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Protocol

from userrl_megatron.rollout.episode import EngineFor, EpisodeRunner
from userrl_megatron.types import Episode, SamplingParams, Task

FINGERPRINT_CHUNKS = 64  # chunks read from each weight file for its fingerprint
FINGERPRINT_CHUNK_BYTES = 1 << 16  # size of each chunk
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class Policy(Protocol):
    """Plays episodes; `identity` names it in results and cache keys."""

    identity: dict[str, Any]
    concurrency: int  # episodes it serves well at once (`eval.max_concurrent_episodes` = 0 uses it)

    async def run(self, task: Task, episode_id: str, sampling: SamplingParams) -> Episode: ...


class TokenPolicy:
    """Episodes through the EpisodeRunner (token in, token out) on the engine `engine_for` gives each episode."""

    def __init__(
        self, runner: EpisodeRunner, engine_for: EngineFor, identity: dict[str, Any], concurrency: int
    ) -> None:
        self.runner = runner
        self.engine_for = engine_for
        self.identity = identity
        self.concurrency = concurrency

    async def run(self, task: Task, episode_id: str, sampling: SamplingParams) -> Episode:
        """One episode; the turns stop at the chat template's end-of-turn tokens."""
        sampling = dataclasses.replace(sampling, stop_token_ids=list(self.runner.chat.stop_token_ids))
        return await self.runner.run(task, self.engine_for(episode_id), task.task_id, sampling, episode_id)


def weights_fingerprint(model_dir: str | Path) -> str:
    """A fingerprint of a model directory's weights and configuration, cheap for large models: each weight file's
    name, size and `FINGERPRINT_CHUNKS` evenly spaced chunks, and every small file (config, tokenizer) whole.
    Training changes every weight, so any chunk of a trained model differs from the base model's."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no files in model directory {root}")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            if path.suffix not in WEIGHT_SUFFIXES or size <= FINGERPRINT_CHUNKS * FINGERPRINT_CHUNK_BYTES:
                digest.update(f.read())
                continue
            step = (size - FINGERPRINT_CHUNK_BYTES) // (FINGERPRINT_CHUNKS - 1)
            for i in range(FINGERPRINT_CHUNKS):
                f.seek(i * step)
                digest.update(f.read(FINGERPRINT_CHUNK_BYTES))
    return digest.hexdigest()[:32]
