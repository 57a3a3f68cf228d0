"""The tensor names an engine accepts in a weight update: those of the checkpoint it loaded.

SGLang 0.5.23 accepts an update naming a tensor its model lacks, reports success and loads nothing. Only some of
its model classes answer `/get_weights_by_name` (llama, opt, granite, exaone4; not Qwen3 or Qwen3-MoE), so the
engine cannot be asked. The checkpoint directory it started from can: its safetensors index, or the headers of its
safetensors files, name every tensor its loader maps, whatever the model class.
"""

import functools
import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
HEADER_MAX_BYTES = 100 * 2**20  # the safetensors format's own limit on a header


@functools.lru_cache(maxsize=8)
def served_names(checkpoint: str) -> frozenset[str] | None:
    """The tensor names of the Hugging Face checkpoint in directory `checkpoint`; None when it has no safetensors
    (a `.bin` checkpoint, an empty path), where names cannot be known without loading the weights."""
    if not checkpoint:
        return None
    folder = Path(checkpoint)
    index = folder / INDEX_FILE
    if index.is_file():
        return frozenset(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    return frozenset(name for file in files for name in _header_names(file))


def _header_names(file: Path) -> list[str]:
    """The tensor names in one safetensors file's header (8 bytes of little-endian length, then JSON)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > HEADER_MAX_BYTES:
            raise ValueError(f"{file}: a safetensors header of {size} bytes (damaged file?)")
        header = json.loads(f.read(size))
    return [name for name in header if name != "__metadata__"]
