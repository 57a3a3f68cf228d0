"""Checkpoint directories on disk: metadata, the `latest` pointer, atomic commit, pruning (no Megatron import).

Kept apart from `checkpoint.py` so that processes which only locate or inspect checkpoints (the CLI parent
process, the trainer's driver) never import megatron.core.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from userrl_megatron.convert.arch import Architecture, padded_vocab_size

FORMAT_VERSION = 1
META_FILE = "userrl_checkpoint.json"
EXTRA_FILE = "extra_state.json"
LATEST = "latest"
HF_METADATA = "hf_metadata"  # the policy's HF config.json and tokenizer, no weights (what an export copies beside them)
LEGACY_HF_METADATA = "hf"  # the same folder in checkpoints written before it was renamed
MANIFEST_FILE = "files.json"  # every file's size, written last: a truncated or missing file shows before loading


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or was saved for another model."""


def hf_metadata_dir(checkpoint: str | Path) -> Path:
    """The folder of `checkpoint` (a resolved checkpoint directory) holding its HF config and tokenizer."""
    folder = Path(checkpoint) / HF_METADATA
    legacy = Path(checkpoint) / LEGACY_HF_METADATA
    return legacy if not folder.is_dir() and legacy.is_dir() else folder


def resolve(path: str | Path) -> Path:
    """The checkpoint directory `path` names: itself, or what its `latest` pointer names."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    if (path / LATEST).is_file():
        target = path / (path / LATEST).read_text().strip()
        if (target / META_FILE).is_file():
            return target
        raise CheckpointError(f"{path / LATEST} points at {target}, which is not a complete checkpoint")
    raise CheckpointError(f"{path} is neither a checkpoint (no {META_FILE}) nor a folder with a {LATEST} pointer")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of the checkpoint `path` names."""
    return json.loads((resolve(path) / META_FILE).read_text())


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest checkpoints directly under `root` (by step, then save time)."""
    found = []
    for child in Path(root).iterdir():
        meta_file = child / META_FILE
        if child.is_dir() and meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            found.append(((meta.get("steps", 0), meta.get("saved_at", 0.0)), child))
    found.sort()
    doomed = [p for _, p in found[: max(len(found) - keep_last, 0)]]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def write_manifest(path: Path) -> None:
    """Record the size of every file of the checkpoint being written at `path`."""
    sizes = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    sizes.pop(MANIFEST_FILE, None)
    (path / MANIFEST_FILE).write_text(json.dumps(sizes, indent=0) + "\n")


def find_damage(path: str | Path) -> str | None:
    """What is wrong with the checkpoint directory `path` (a missing or truncated file), or None.

    Checkpoints written before manifests existed are only checked for their metadata file."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        return f"{META_FILE} is missing"
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return None
    try:
        sizes = json.loads(manifest.read_text())
    except ValueError:
        return f"{MANIFEST_FILE} is unreadable"
    for name, size in sizes.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def checkpoints_newest_first(root: str | Path) -> list[Path]:
    """The complete checkpoints directly under `root`, the one `latest` names first, then by step and time."""
    root = Path(root)
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        meta_file = child / META_FILE
        if child.is_dir() and not child.name.startswith(".") and meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            found.append(((_step_of(child), meta.get("saved_at", 0.0)), child))
    ordered = [p for _, p in sorted(found, reverse=True)]
    latest = root / LATEST
    if latest.is_file() and (root / latest.read_text().strip()) in ordered:
        named = root / latest.read_text().strip()
        ordered = [named] + [p for p in ordered if p != named]
    return ordered


def _step_of(path: Path) -> int:
    tail = path.name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def commit(tmp: Path, path: Path, pointer: bool = True) -> None:
    """Rename the finished checkpoint into place, then (`pointer`) move the `latest` pointer beside it (each
    step atomic)."""
    old = path.parent / f".{path.name}.replaced"
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if pointer:
        staged = path.parent / f".{LATEST}.tmp"
        staged.write_text(path.name + "\n")
        os.replace(staged, path.parent / LATEST)
    if old.exists():
        shutil.rmtree(old)


def check_compatible(meta: dict[str, Any], arch: Architecture, tp: int) -> None:
    """Raise CheckpointError if the checkpoint holds another model, or its vocab padding differs at this TP."""
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}")
    current = dataclasses.asdict(arch)
    diff = {k: (meta["arch"].get(k), v) for k, v in current.items() if meta["arch"].get(k) != v}
    if diff:
        raise CheckpointError(f"checkpoint holds another model: (checkpoint, current) differ in {diff}")
    padded = padded_vocab_size(arch.vocab_size, tp)
    if padded != meta["padded_vocab_size"]:
        raise CheckpointError(
            f"the checkpoint's vocabulary is padded to {meta['padded_vocab_size']} rows (TP = {meta['layout']['tp']}); "
            f"tensor_model_parallel_size = {tp} pads it to {padded}: use a TP that pads it the same way"
        )
