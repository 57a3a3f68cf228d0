"""The actor ranks as one handle (`Actors`): what RL (`trainer/`) and SFT (`sft/`) call on every Megatron rank.

`actors.workers.ActorGroup` meets it in a run, the planner's `plan.ledger.LedgerActors` in `userrl plan`; the type
checker holds both to these signatures.
"""

from typing import Any, Protocol

from userrl_megatron.config.schema import CheckpointConfig
from userrl_megatron.types import TrainBatch


class Actors(Protocol):
    """Every Megatron rank at once: each method is a collective that runs on all ranks and returns rank 0's
    answer."""

    def compute_logprobs(self, batch: TrainBatch, trained_only: bool = False) -> list[list[float]]:
        """Log-probs of every token (`trained_only`: of the trained tokens) under the current weights."""
        ...

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Log-probs of the trained tokens under the initial weights (the KL reference)."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over `batch`; its metrics."""
        ...

    def save(self, path: str, extra_state: dict[str, Any], ckpt: CheckpointConfig, background: bool) -> None:
        """Write a checkpoint (`background`: from host copies, committed by `finish_save`)."""
        ...

    def finish_save(self, wait: bool) -> bool:
        """Whether the background save is written (`wait`: block until it is)."""
        ...

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        """Restore a checkpoint; the extra state it was saved with."""
        ...

    def load_weights(self, path: str) -> None:
        """Take the weights of a checkpoint, nothing else (a fresh optimizer)."""
        ...

    def offload(self, weights: bool = True) -> None:
        """Move grads and optimizer state (and `weights`) to host memory."""
        ...

    def onload(self, weights_only: bool = False) -> None:
        """Bring offloaded state back to the devices."""
        ...

    def offloaded(self) -> list[str]:
        """The kinds of state in host memory now ("weights", "grads", "optimizer")."""
        ...

    def export_hf(self, out_dir: str) -> str | None:
        """Write the weights as a Hugging Face directory."""
        ...

    def connect_engines(self, engines: list[dict[str, Any]], group_prefix: str, method: str) -> list[str]:
        """One weight-sync group per pipeline stage with `engines`; the groups' names."""
        ...

    def push_weights(self, group_names: list[str], version: int) -> dict[str, float]:
        """Stream the weights to the engines of `group_names`; the transfer's metrics."""
        ...

    def disconnect_engines(self, group_names: list[str]) -> None: ...

    def weight_checksums(self, rows: int) -> dict[str, float]:
        """Sum of the first `rows` rows of every exported tensor, by HF name."""
        ...
