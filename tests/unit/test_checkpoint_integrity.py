"""Checkpoint integrity (issue 57, item 5): a `latest` that is not a file is refused before start (N15), and a
payload changed in place, same size, is found by its SHA-256 on resume; the writer thread hashes what it wrote."""

import hashlib
import json
import queue
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from userrl_megatron.config import ConfigError, load_config
from userrl_megatron.megatron.checkpoint_writer import CheckpointWriter
from userrl_megatron.run.checkpoint_files import (
    DIGESTS_DIR,
    EXTRA_FILE,
    FORMAT_VERSION,
    LATEST,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
    checkpoints_newest_first,
    commit,
    find_damage,
    newest_intact,
    prune,
    write_manifest,
)
from userrl_megatron.trainer.preflight import check_before_start

DATA = "__0_0.distcp"


def save(root: Path, step: int) -> Path:
    """Checkpoint `step_<step>` as `save_state` writes it: files, manifest, commit (moves `latest`)."""
    tmp = root / f".step_{step}.incomplete"
    tmp.mkdir(parents=True)
    (tmp / DATA).write_bytes(bytes(range(256)) * 4)
    (tmp / "rng").mkdir()
    (tmp / "rng" / "rank_00000.pt").write_bytes(b"rng")
    (tmp / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "saved_at": float(step)}) + "\n")
    (tmp / EXTRA_FILE).write_text(json.dumps({"step": step}) + "\n")
    write_manifest(tmp)
    commit(tmp, root / f"step_{step}")
    return root / f"step_{step}"


def test_a_latest_directory_is_refused_before_start(tmp_path: Path) -> None:
    """N15: `checkpoints/latest` a directory made every save fail at dafaaeb (a file cannot replace it), after
    the whole start-up; now the run is refused before anything starts, in one line, whatever it resumes from."""
    (tmp_path / "r" / "checkpoints" / LATEST).mkdir(parents=True)
    pointer = tmp_path / "r" / "checkpoints" / LATEST
    line = (
        f"{pointer} is a directory, not the file naming the newest checkpoint, and every save would fail to "
        "replace it: move it away"
    )
    for resume in ("auto", "disable"):
        cfg = load_config(overrides=[f"run.output_dir={tmp_path}", "run.name=r", f"checkpoint.resume={resume}"])
        with pytest.raises(ConfigError) as e:
            check_before_start(cfg, on_gpu=False)
        assert e.value.problems == [line]
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoints_newest_first(tmp_path / "r" / "checkpoints")


def test_a_same_size_corruption_is_found_on_resume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A byte of the payload changed in place: sizes agree, the SHA-256 does not. A resume passes over the
    checkpoint to the one before (at dafaaeb it loaded the damaged one); pruning and a save's failure path,
    which run on the training thread, still check sizes only."""
    root = tmp_path / "checkpoints"
    save(root, 1)
    newest = save(root, 2)
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    assert manifest[DATA] == {"bytes": 1024, "sha256": hashlib.sha256(bytes(range(256)) * 4).hexdigest()}
    assert set(manifest) == {DATA, "rng/rank_00000.pt", META_FILE, EXTRA_FILE}
    with (newest / DATA).open("r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    assert find_damage(newest) is None  # sizes only
    assert find_damage(newest, checksums=True) == f"{DATA} does not hold the bytes that were written (SHA-256 differs)"
    assert newest_intact(checkpoints_newest_first(root)) == root / "step_1"
    assert "resuming from" in caplog.text
    assert prune(root, keep_last=2) == []


def test_a_manifest_of_sizes_only_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before checksums (a manifest of sizes) are checked for sizes."""
    newest = save(tmp_path / "checkpoints", 1)
    sizes = {name: entry["bytes"] for name, entry in json.loads((newest / MANIFEST_FILE).read_text()).items()}
    (newest / MANIFEST_FILE).write_text(json.dumps(sizes))
    assert find_damage(newest, checksums=True) is None


@pytest.mark.parametrize("background", [False, True])
def test_the_writer_thread_hashes_what_it_wrote(tmp_path: Path, background: bool) -> None:
    """The thread that writes a rank's files leaves their digests for the manifest (the training thread hashes
    only the small files the commit writes)."""
    target = tmp_path / ".step_1.incomplete"
    target.mkdir()
    written: list[str] = []

    def write(rank: int, buckets: list[Any], results: queue.Queue) -> None:
        for file_name, _, _ in buckets:
            Path(file_name).write_bytes(b"payload")
            written.append(file_name)

    buckets = [(str(target / DATA), "key", ([], []))]
    request = SimpleNamespace(async_fn=write, async_fn_args=(0, buckets, queue.Queue()), async_fn_kwargs={})
    request.finalize_fns, request.preload_fn = [lambda: None], None
    writer = CheckpointWriter(torch.device("cpu"))
    writer.run(request, background)
    writer.wait()
    assert written == [str(target / DATA)]
    digest = (target / DIGESTS_DIR / f"{DATA}.sha256").read_text().strip()
    assert digest == hashlib.sha256(b"payload").hexdigest()
    (target / META_FILE).write_text("{}")
    write_manifest(target)
    assert not (target / DIGESTS_DIR).exists()
    assert json.loads((target / MANIFEST_FILE).read_text())[DATA] == {"bytes": 7, "sha256": digest}
