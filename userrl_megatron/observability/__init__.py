"""Metrics fan-out (console, metrics.jsonl, wandb, TensorBoard) and timers."""

from userrl_megatron.observability.timers import Timers
from userrl_megatron.observability.tracker import Tracker, read_metrics

__all__ = ["Timers", "Tracker", "read_metrics"]
