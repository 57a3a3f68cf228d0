"""What an engine's generate call returns (`Generation`) and how a refused or failed call shows (`EngineError`):
the same for the HTTP client (`fleet/engine.py`) and the in-process engine (`server/local.py`)."""

from dataclasses import dataclass

import numpy as np


class EngineError(RuntimeError):
    """An engine refused or failed a call (SGLang `success: false`, a 4xx/5xx, or no answer after retries)."""


@dataclass
class Generation:
    """The result of one generate call."""

    output_ids: list[int]
    output_logprobs: list[float]  # log-prob of each output token under the engine's weights
    finish_reason: str  # "stop" (EOS or a stop token), "length" (max_new_tokens) or "abort"
    weight_version: str = "default"
    prompt_tokens: int = 0
    latency_s: float = 0.0
    # MoE routing replay: the expert ids the engine routed each position to, int32 [positions, layers x top_k],
    # for positions routed_experts_start_len … prompt + output - 2 (SGLang's rows); None unless asked for
    routed_experts: np.ndarray | None = None
