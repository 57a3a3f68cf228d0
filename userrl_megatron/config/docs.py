"""Field documentation: the one-line comment written after each field in `schema.py`."""

import dataclasses
import inspect
import io
import tokenize
from functools import cache
from typing import Any

import yaml

from userrl_megatron.config.schema import RootConfig


@cache
def field_docs(schema: type) -> dict[str, str]:
    """Map each field of a config dataclass to its doc: the comment that follows it on its line (in the class, or a
    base class, that declares it), or its `doc` metadata (a gym section of `GymsConfig`)."""
    comments: dict[str, str] = {}
    for klass in reversed(schema.__mro__):
        if "__dataclass_fields__" in vars(klass):
            comments.update(_comments(klass))
    return {f.name: f.metadata.get("doc") or comments.get(f.name, "") for f in dataclasses.fields(schema)}


def _comments(schema: type) -> dict[str, str]:
    """The comment after each field line in `schema`'s source ({} where it has none: a class made at run time)."""
    try:
        source = inspect.getsource(schema)
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    field_on_line: dict[int, str] = {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        # A field is a NAME at indentation 4 followed by ':'.
        if tok.type == tokenize.NAME and tok.start[1] == 4 and nxt is not None and nxt.string == ":":
            field_on_line[tok.start[0]] = tok.string
        elif tok.type == tokenize.COMMENT and tok.start[0] in field_on_line:
            docs[field_on_line[tok.start[0]]] = tok.string.lstrip("#").strip()
    return docs


def explain(cfg: Any = None, schema: type = RootConfig, indent: int = 0) -> str:
    """YAML of `cfg` (defaults when None) with every field's doc as a trailing comment."""
    cfg = cfg if cfg is not None else schema()
    lines: list[str] = []
    kind: type = type(cfg)
    for name, doc in field_docs(kind).items():
        value = getattr(cfg, name)
        pad = " " * indent
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{name}:  # {doc}")
            lines.append(explain(value, type(value), indent + 2))
        else:
            rendered = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
            rendered = rendered.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{pad}{name}: {rendered}  # {doc}")
    return "\n".join(lines)
