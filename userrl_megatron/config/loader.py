"""Load a RootConfig: dataclass defaults, then each YAML file in order, then dotted `key=value` overrides.

A file may rest on others: its top-level `base:` (a path or a list, relative to the file) names files merged
beneath every given file (their own bases beneath them), so a base sets only what no given file sets. A layout
file names the model it was made for this way (`base: ../model/qwen3-8b.yaml`): `--config
configs/layout/qwen3-8b-h100x8.yaml` alone plans Qwen3-8B, and `--config my_recipe.yaml --config <that layout>`
keeps the recipe's `model.path`.

Unknown keys and wrong types are reported with the dotted key, the closest valid key and the expected type,
before any work starts. Callers get typed dataclasses, never an OmegaConf DictConfig.
"""

import dataclasses
import difflib
import os
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from userrl_megatron.config.gyms import GymsConfig, gyms_config_type
from userrl_megatron.config.schema import RootConfig


class ConfigError(ValueError):
    """Configuration problems, each phrased for the person who wrote the config (one `userrl: error:` line
    each)."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:  # keeps the problem list across Ray and pickling
        return (type(self), (self.problems,))


def load_config(
    files: Sequence[str | Path] = (), overrides: Sequence[str] = (), check: bool = True, command: str = "train"
) -> RootConfig:
    """Resolve the configuration from defaults, YAML files (in order) and `a.b=value` overrides.

    `command` names the run when `run.name` is left empty: `<command>-<model directory name>`, so runs of other
    models or other commands never share (and resume from) one run directory."""
    from omegaconf import OmegaConf  # here, not at import: `userrl --help` loads the config package, not OmegaConf

    merged = OmegaConf.structured(RootConfig)
    stacks = [_with_bases(Path(path)) for path in files]
    bases = {source: raw for stack in stacks for source, raw in stack[:-1]}  # each base once, first place kept
    for source, raw in [*bases.items(), *(stack[-1] for stack in stacks)]:
        _check_keys(raw, RootConfig, prefix="", source=source)
        merged = _merge(merged, raw, source=source)
    if overrides:
        raw = _parse_overrides(overrides)
        _check_keys(raw, RootConfig, prefix="", source="command line")
        merged = _merge(merged, raw, source="command line")
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, RootConfig)
    if not cfg.run.name:
        cfg.run.name = f"{command}-{Path(cfg.model.path.rstrip('/')).name or 'model'}"
    if check:
        from userrl_megatron.config.checks import check_config

        check_config(cfg)
    return cfg


def to_yaml(cfg: RootConfig) -> str:
    """The resolved configuration as YAML (what `config show` prints and the run directory keeps)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: RootConfig, path: str | Path) -> None:
    """Write the resolved configuration to `path`."""
    Path(path).write_text(to_yaml(cfg))


def _with_bases(path: Path, chain: tuple[Path, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """(source name, keys) of `path`'s bases, depth first, then of `path` itself: the order they merge in."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: the base files form a cycle: {cycle}")
    raw = _read_yaml(path)
    bases = raw.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise ConfigError(f"{path}: base must be a file path or a list of them (relative to the file), got {bases!r}")
    merged: list[tuple[str, dict[str, Any]]] = []
    for base in bases:
        base_path = Path(os.path.normpath(path.parent / base))
        if not base_path.is_file():
            raise ConfigError(f"{path}: base file not found: {base} (looked for {base_path})")
        merged += _with_bases(base_path, (*chain, path.resolve()))
    return [*merged, (str(path), raw)]


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like section.key=value, got: {' '.join(bad)}")
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))  # type: ignore[return-value]


def _merge(base: Any, raw: dict[str, Any], source: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(base, raw)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        expected = _type_name(_field_type(key))
        value = _lookup(raw, key)
        raise ConfigError(
            f"{source}: {key} expects {expected}, got {value!r} ({type(value).__name__})"
            if expected
            else f"{source}: {key}: {getattr(e, 'msg', e)}"
        ) from None


def _check_keys(raw: Any, schema: type, prefix: str, source: str) -> None:
    """Reject keys the schema does not have, naming the closest valid key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = _hints(schema)
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{source}: unknown key '{dotted}'{_suggestion(str(key), prefix, hints)}")
        sub = hints[key]
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and value is not None:
            _check_keys(value, sub, f"{dotted}.", source)


def _suggestion(key: str, prefix: str, hints: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.5)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    # The key may belong to another section: rollout.lr -> megatron.lr.
    elsewhere = [p for p in _leaf_paths(RootConfig) if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f" (did you mean '{elsewhere[0]}'?)"
    return f"; valid keys here: {', '.join(sorted(hints))}"


def _leaf_paths(schema: type, prefix: str = "") -> list[str]:
    paths = []
    for name, sub in _hints(schema).items():
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            paths += _leaf_paths(sub, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def _field_type(dotted: str) -> Any:
    node: Any = RootConfig
    for part in dotted.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        node = _hints(node).get(part)
    return node


def _hints(schema: type) -> dict[str, Any]:
    """Field -> type of a config dataclass, the `gyms` section typed with every registered gym's settings."""
    hints = typing.get_type_hints(schema)
    typed = {f.name: hints[f.name] for f in dataclasses.fields(schema)}
    return {name: gyms_config_type() if hint is GymsConfig else hint for name, hint in typed.items()}


def _type_name(tp: Any) -> str:
    if tp is None:
        return ""
    origin = typing.get_origin(tp)
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _lookup(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
