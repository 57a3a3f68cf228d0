"""Checkpoint directories on disk: metadata, the `latest` pointer, atomic commit, pruning (no Megatron import).

The writer (`megatron/checkpoint.py`) and every reader share it; it lives in `run/`, with the run directory it
lays out, so that processes which only locate or inspect checkpoints (the CLI parent process, the trainer's
driver, `userrl train`'s checks before start) import neither megatron.core nor torch.

A run's history is what `latest` names and the checkpoints of lower steps before it: after a resume from an
older checkpoint (a fallback past a damaged one), checkpoints of higher steps belong to an abandoned history.
Resume candidates and pruning follow that history, never the largest number. `latest` only names a folder
beside it; symbolic links are never followed, and nothing found in the folder (a link, a damaged checkpoint,
unreadable metadata) makes pruning raise after a commit.
"""

import dataclasses
import hashlib
import json
import logging
import os
import re
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
MANIFEST_FILE = "files.json"  # every file's size and SHA-256, written last: damage shows before loading
DIGESTS_DIR = ".digests"  # the writer threads' SHA-256 of the files they wrote, merged into the manifest
STEP_NAME = re.compile(r"step_(\d+)")  # what the trainers name their checkpoints (the only folders pruning deletes)

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or was saved for another model."""


def hf_metadata_dir(checkpoint: str | Path) -> Path:
    """The folder of `checkpoint` (a resolved checkpoint directory) holding its HF config and tokenizer."""
    folder = Path(checkpoint) / HF_METADATA
    legacy = Path(checkpoint) / LEGACY_HF_METADATA
    return legacy if not folder.is_dir() and legacy.is_dir() else folder


def latest_target(root: str | Path) -> Path | None:
    """The folder `root/latest` names (which may be missing), or None without a pointer.

    Raise CheckpointError naming the pointer when it names anything but a folder directly inside `root` (a
    path elsewhere, `..`, or a symbolic link leading out), or when it is not a file (a directory)."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.exists() and not pointer.is_file():  # a directory (or a FIFO): no save could replace it
        kind = "a directory" if pointer.is_dir() else "not a regular file"
        raise CheckpointError(
            f"{pointer} is {kind}, not the file naming the newest checkpoint, and every save would fail to replace "
            "it: move it away"
        )
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    target = root / name
    if not name or name in (".", "..") or Path(name).name != name:
        raise CheckpointError(f"{pointer} points outside {root} ({name!r}): it may only name a checkpoint beside it")
    if target.is_symlink():
        raise CheckpointError(f"{pointer} names {target}, a symbolic link: it may only name a checkpoint beside it")
    return target


def resolve(path: str | Path) -> Path:
    """The checkpoint directory `path` names: itself, or what its `latest` pointer names (only inside `path`)."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    target = latest_target(path)
    if target is not None:
        if (target / META_FILE).is_file():
            return target
        raise CheckpointError(f"{path / LATEST} points at {target}, which is not a complete checkpoint")
    raise CheckpointError(f"{path} is neither a checkpoint (no {META_FILE}) nor a folder with a {LATEST} pointer")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of the checkpoint `path` names."""
    return json.loads((resolve(path) / META_FILE).read_text())


def prune(root: str | Path, keep_last: int, current: str | Path | None = None) -> list[Path]:
    """Delete the `step_N` checkpoints under `root` but the `keep_last` newest of the run's history; the deleted.

    The history starts at `current` (the checkpoint just committed), else at what `latest` names; both are always
    kept. Damaged checkpoints and those past the history's step (another history's) are left in place with a
    warning and not counted; links, other folders and an unreadable pointer likewise. Never raises: it runs after
    a commit, when a failure would stop a run whose checkpoint is safe."""
    root = Path(root)
    try:
        named = latest_target(root)
    except (CheckpointError, OSError) as e:
        log.warning("pruning %s: %s; only the checkpoint just written is known to be current", root, e)
        named = None
    protected = {p.name for p in (Path(current) if current is not None else None, named) if p is not None}
    head = Path(current) if current is not None else named
    intact, left = [], []
    try:
        listing = sorted(_listing(root), key=_order, reverse=True)
    except OSError as e:
        log.warning("pruning %s: cannot list it (%s)", root, e)
        listing = []
    for child in listing:
        if not STEP_NAME.fullmatch(child.name):
            continue  # not written by a trainer: the person's
        try:
            damage = find_damage(child)
        except OSError as e:
            damage = f"unreadable: {e}"
        if damage is not None:
            left.append(f"{child.name} (damaged: {damage})")
        elif head is not None and _past(child, head):
            left.append(f"{child.name} (past the current {head.name}: another history's)")
        else:
            intact.append(child)
    history = sorted(intact, key=lambda p: (head is not None and p.name == head.name, _step_of(p)), reverse=True)
    doomed = [p for p in history[max(keep_last, 1) :] if p.name not in protected]
    if left:
        log.warning("pruning %s left %s: not counted as kept; delete when no longer needed", root, ", ".join(left))
    removed = []
    for p in doomed:
        try:
            shutil.rmtree(p)
            removed.append(p)
        except OSError as e:
            log.warning("pruning %s: could not delete %s (%s)", root, p.name, e)
    return removed


def write_manifest(path: Path) -> None:
    """Record the size and SHA-256 of every file of the checkpoint being written at `path`: the digests the
    writer threads left in `.digests/` (`record_digests`), the other files hashed here (they are small)."""
    found = {}
    for digests in [d for d in path.rglob(DIGESTS_DIR) if d.is_dir()]:
        for f in digests.iterdir():
            found[str((digests.parent / f.name.removesuffix(".sha256")).relative_to(path))] = f.read_text().strip()
        shutil.rmtree(digests)
    entries = {}
    for f in sorted(path.rglob("*")):
        name = str(f.relative_to(path))
        if f.is_file() and name != MANIFEST_FILE:
            entries[name] = {"bytes": f.stat().st_size, "sha256": found.get(name) or file_sha256(f)}
    (path / MANIFEST_FILE).write_text(json.dumps(entries, indent=0) + "\n")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hashlib releases the GIL: other threads go on meanwhile)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_digests(files: list[str]) -> None:
    """Leave the SHA-256 of each of `files` (written into a checkpoint folder being saved) in that folder's
    `.digests/`, for `write_manifest`: the writer threads hash what they wrote, not the training thread."""
    for name in files:
        f = Path(name)
        out = f.parent / DIGESTS_DIR
        out.mkdir(exist_ok=True)
        (out / f"{f.name}.sha256").write_text(file_sha256(f) + "\n")


def find_damage(path: str | Path, checksums: bool = False) -> str | None:
    """What is wrong with the checkpoint directory `path` (a missing, truncated or unreadable file, and with
    `checksums` a file whose bytes differ from those written), or None.

    Checkpoints written before manifests existed are only checked for their metadata file, and those whose
    manifest holds sizes only (before checksums) for sizes."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        return f"{META_FILE} is missing"
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text())
        except ValueError:
            entries = None
        if not isinstance(entries, dict):
            return f"{MANIFEST_FILE} is unreadable"
        for name, entry in entries.items():
            size, digest = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (entry, None)
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != size:
                return f"{name} has {f.stat().st_size} bytes, {size} were written"
            if checksums and digest is not None and file_sha256(f) != digest:
                return f"{name} does not hold the bytes that were written (SHA-256 differs)"
    try:
        if not isinstance(json.loads((path / META_FILE).read_text()), dict):
            return f"{META_FILE} is unreadable"
    except ValueError:  # UnicodeDecodeError included
        return f"{META_FILE} is unreadable"
    return None


def checkpoints_newest_first(root: str | Path) -> list[Path]:
    """The run's history under `root`, newest first: the checkpoint `latest` names, then those of lower steps.

    Damaged ones are listed (see `find_damage`); a missing one `latest` names is not, nor are checkpoints past its
    step (another history's). Without `latest`, every checkpoint by step. Links are skipped with a warning.
    Raise CheckpointError when `latest` points outside `root`."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted(_listing(root), key=_order, reverse=True)
    head = latest_target(root)
    if head is None:
        return found
    older = [p for p in found if p != head and not _past(p, head)]
    return [head, *older] if head in found else older


def newest_intact(candidates: list[Path]) -> Path | None:
    """The first undamaged of `candidates` (newest first; checksums checked: it is what a resume loads); each
    damaged one before it is logged as an error naming the one resumed instead. None without candidates;
    CheckpointError when every one is damaged."""
    for i, path in enumerate(candidates):
        damage = find_damage(path, checksums=True)
        if damage is None:
            return path
        if i + 1 == len(candidates):
            raise CheckpointError(
                f"checkpoint {path} is damaged ({damage}) and no older one is kept: move it away to restart the run "
                "from its initial weights"
            )
        log.error("checkpoint %s is damaged (%s): resuming from %s instead", path, damage, candidates[i + 1])
    return None


def _listing(root: Path) -> list[Path]:
    """The checkpoint folders directly under `root` (a metadata file or a manifest), unsorted; hidden ones (being
    written or replaced) left out, links skipped with a warning."""
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or child.name == LATEST:
            continue
        if child.is_symlink():
            log.warning("%s is a symbolic link: skipped (checkpoints are never followed through links)", child)
        elif child.is_dir() and ((child / META_FILE).is_file() or (child / MANIFEST_FILE).is_file()):
            found.append(child)
    return found


def _step_of(path: Path) -> int:
    tail = path.name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _order(path: Path) -> tuple[int, str]:
    return _step_of(path), path.name


def _past(path: Path, head: Path) -> bool:
    """Whether `path` is past the history that starts at `head` (a higher step: another history's)."""
    return _step_of(head) >= 0 and _step_of(path) > _step_of(head)


def commit(tmp: Path, path: Path, pointer: bool = True) -> None:
    """Rename the finished checkpoint into place, then (`pointer`) move the `latest` pointer beside it (each
    step atomic). What it replaces (a checkpoint of the same step, damaged or not; a link: only the link) goes."""
    old = path.parent / f".{path.name}.replaced"
    if path.is_symlink() or path.exists():
        _remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if pointer:
        staged = path.parent / f".{LATEST}.tmp"
        staged.write_text(path.name + "\n")
        os.replace(staged, path.parent / LATEST)
    try:
        _remove(old)
    except OSError as e:  # committed: a leftover costs disk space, not the run
        log.warning("could not delete %s, which %s replaced (%s)", old, path, e)


def _remove(path: Path) -> None:
    """Delete a folder, or only the link when `path` is a symbolic link."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


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
