"""Reading and writing Hugging Face model directories (safetensors, sharded or not) without loading a model.

`HFWeights` opens the safetensors files lazily, so each rank reads only the tensors it needs.
`save_hf_dir` writes sharded safetensors with an index, plus every non-weight file of the source model
(config, generation config, tokenizer files, chat template), so the result loads in `transformers`; `ShardWriter`
and `publish` are its two halves, which a pipeline-parallel export runs on different ranks.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


class HFWeights:
    """Lazy access to the tensors of an HF safetensors directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            self._file_of = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE_FILE).is_file():
            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                self._file_of = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{self.path} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors are read)")
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        """Names of every tensor."""
        return list(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        return self._handles[file].get_tensor(name)  # type: ignore[attr-defined]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (name, tensor), read one at a time."""
        for name in self._file_of:
            yield name, self[name]


def metadata_files(path: str | Path) -> list[Path]:
    """The files of an HF model directory that are not weights: config, tokenizer, generation config, ..."""
    return sorted(
        p
        for p in Path(path).iterdir()
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.name not in WEIGHT_INDEXES
    )


def copy_metadata(source: str | Path, target: str | Path) -> None:
    """Copy the non-weight files of an HF model directory into `target`."""
    Path(target).mkdir(parents=True, exist_ok=True)
    for p in metadata_files(source):
        shutil.copy2(p, Path(target) / p.name)


def save_hf_dir(
    out: str | Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    metadata_source: str | Path,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF model directory atomically: safetensors shards (+ index when more than one), and the
    non-weight files of `metadata_source`. `tensors` is a state dict or a stream of (name, tensor) pairs; at
    most one shard is held in memory. `dtype` casts floating tensors and is recorded in config.json."""
    if isinstance(tensors, Mapping):
        tensors = tensors.items()
    out = Path(out)
    folder = staging_dir(out)
    try:
        writer = ShardWriter(folder, "part", max_shard_bytes, dtype)
        for name, tensor in tensors:
            writer.add(name, tensor)
        publish(folder, writer.close(), out, metadata_source, dtype)
    finally:
        if folder.exists():
            shutil.rmtree(folder)
    return out


class ShardWriter:
    """Writes (name, tensor) pairs into safetensors files of at most `max_shard_bytes` as they come, so one shard
    at most is held in memory (`peak_bytes` records how much that was). `close()` lists the files written."""

    def __init__(self, folder: Path, prefix: str, max_shard_bytes: int, dtype: torch.dtype | None = None) -> None:
        self.folder, self.prefix, self.max_shard_bytes, self.dtype = folder, prefix, max_shard_bytes, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.size = self.peak_bytes = 0
        self.files: list[tuple[str, dict[str, int]]] = []  # (file, {tensor name: bytes})

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.size += nbytes
        self.peak_bytes = max(self.peak_bytes, self.size)

    def close(self) -> list[tuple[str, dict[str, int]]]:
        if self.pending:
            self._flush()
        return self.files

    def _flush(self) -> None:
        file = f"{self.prefix}-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, self.folder / file, metadata={"format": "pt"})
        self.files.append((file, {n: t.numel() * t.element_size() for n, t in self.pending.items()}))
        self.pending, self.size = {}, 0


def staging_dir(out: Path) -> Path:
    """A fresh directory beside `out` to write an export into before it is published as `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))


def publish(
    folder: Path,
    files: list[tuple[str, dict[str, int]]],
    out: Path,
    metadata_source: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Finish an export written into `folder`: the shard `files` (in order) take their HF names (one file:
    model.safetensors; several: model-k-of-n with an index), the metadata is copied, modes opened like any
    model directory, and the folder atomically becomes `out`."""
    if len(files) == 1:
        os.replace(folder / files[0][0], folder / SINGLE_FILE)
    else:
        weight_map, total = {}, 0
        for k, (file, sizes) in enumerate(files, start=1):
            final = f"model-{k:05d}-of-{len(files):05d}.safetensors"
            os.replace(folder / file, folder / final)
            weight_map.update(dict.fromkeys(sizes, final))
            total += sum(sizes.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    copy_metadata(metadata_source, folder)
    if dtype is not None:
        _set_config_dtype(folder / "config.json", dtype)
    publish_permissions(folder)
    if out.exists():
        shutil.rmtree(out)
    os.replace(folder, out)


def publish_permissions(folder: str | Path) -> None:
    """Give `folder` and everything in it the modes a plain `mkdir` / file write would (0755 / 0644 under the
    usual umask 022): temporary directories are created 0700 and some writers create 0600 files, which would
    leave an exported model readable by its owner only."""
    umask = os.umask(0)
    os.umask(umask)
    folder = Path(folder)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _set_config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2) + "\n")
