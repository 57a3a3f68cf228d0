"""The tracker with the real wandb (offline) and a real TensorBoard event file, read back."""

import io
import json
import struct
from pathlib import Path

from rich.console import Console

from userrl_megatron.config import LoggingConfig
from userrl_megatron.observability import Timers, Tracker, read_metrics


def _read_wandb_history(run_dir: Path) -> list[dict]:
    """History rows of an offline .wandb file (LevelDB log framing of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, pending, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind in (2, 3):
            pending += chunk
    return rows


def test_tracker_fans_out_to_every_backend(tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = LoggingConfig(backends=["console", "wandb", "tensorboard"], wandb_mode="offline")
    with Tracker(cfg, tmp_path, run_name="t", config={"algo": {"gamma": 0.8}}, console=Console(file=out)) as tracker:
        tracker.log({"reward/mean": 0.25, "train/loss": -1.5}, step=1)
        tracker.log({"reward/mean": 0.75, "timing/step": 2.0}, step=2)

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward/mean"] == 0.25 and records[1]["timing/step"] == 2.0

    assert "step 1  reward/mean=0.25  train/loss=-1.5" in out.getvalue()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_dir,) = {p.parent for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*")}
    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]

    history = _read_wandb_history(tmp_path)
    assert [(h["_step"], h["reward/mean"]) for h in history] == [(1, 0.25), (2, 0.75)]
    assert history[0]["train/loss"] == -1.5


def test_jsonl_is_always_on_and_appends_across_restarts(tmp_path: Path) -> None:
    for step in (1, 2):
        with Tracker(LoggingConfig(backends=[]), tmp_path) as tracker:
            tracker.log({"x": float(step), "bad": float("nan")}, step=step)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["x"] for r in records] == [1.0, 2.0] and records[0]["bad"] == "nan"


def test_timers_accumulate_and_reset() -> None:
    ticks = iter([0.0, 1.5, 10.0, 10.25, 20.0, 21.0])
    timers = Timers(clock=lambda: next(ticks))
    with timers("rollout"):
        pass
    with timers("rollout"):
        pass
    with timers("train"):
        pass
    assert timers.pop() == {"timing/rollout": 1.75, "timing/train": 1.0}
    assert timers.pop() == {}
