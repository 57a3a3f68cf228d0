"""Fields that name an environment variable (`*_env`, e.g. `user_sim.api_key_env`) must hold a name, not a key.

A pasted API key would be saved into the run's config.yaml and sent nowhere (the variable it "names" is unset),
so it is refused, and the message never repeats the value. `none` means "no key" (a server without auth).
"""

import dataclasses
import re
from typing import Any

from userrl_megatron.config.schema import RootConfig

NO_KEY = "none"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Prefixes of well-known credential formats (OpenAI, Anthropic, GitHub, Hugging Face, Slack, AWS, Google, GitLab).
_KEY_PREFIXES = ("sk-", "sk_", "ghp_", "gho_", "ghs_", "github_pat_", "hf_", "xox", "akia", "aiza", "glpat-")


def env_field_problems(cfg: RootConfig) -> list[str]:
    """One problem per `*_env` field whose value is not an environment-variable name (or `none`)."""
    return [problem for dotted, value in _env_fields(cfg, "") if (problem := env_name_problem(dotted, value))]


def env_name_problem(dotted: str, value: str) -> str:
    """Why `value` cannot be the variable name `dotted` asks for ("" when it can); never quotes `value`."""
    if value == NO_KEY:
        return ""
    if looks_like_secret(value):
        return (
            f"{dotted} holds what looks like a secret key ({len(value)} characters, not shown): it must name the "
            "environment variable that holds the key (e.g. OPENAI_API_KEY), or be none for a server without auth; "
            "export the key in that variable and remove it from the config"
        )
    if not _NAME.fullmatch(value):
        return (
            f"{dotted} must name an environment variable (letters, digits and _, not starting with a digit; "
            f"e.g. OPENAI_API_KEY), or be none for a server without auth; got a {len(value)}-character value "
            "that is not a name (not shown)"
        )
    return ""


def looks_like_secret(value: str) -> bool:
    """A credential-like string: a known key prefix, or long with digits and lower-case letters mixed in
    (variable names are short and, by convention, upper case)."""
    if value.lower().startswith(_KEY_PREFIXES):
        return True
    if len(value) >= 64:
        return True
    mixed = any(c.isdigit() for c in value) and any(c.islower() for c in value)
    return len(value) >= 24 and mixed


def _env_fields(node: Any, prefix: str) -> list[tuple[str, str]]:
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found += _env_fields(value, f"{prefix}{f.name}.")
        elif f.name.endswith("_env") and isinstance(value, str):
            found.append((f"{prefix}{f.name}", value))
    return found
