"""The bearer-token check of an engine's HTTP API, as SGLang 0.5.23 (`sglang/srt/utils/auth.py`): which requests
need no key, and whether a request's `Authorization` header carries the key. The key itself is made and handed
over in `fleet/auth.py` (docs/engine.md, "Security model")."""

import secrets

# Paths anyone may call on a server with a key, as SGLang 0.5.23 (`sglang/srt/utils/auth.py`): prefixes.
PUBLIC_PREFIXES = ("/health", "/ready", "/metrics")


def is_public(method: str, path: str) -> bool:
    """Whether a request needs no key (SGLang's rule: OPTIONS, health, readiness and metrics)."""
    return method == "OPTIONS" or path.startswith(PUBLIC_PREFIXES)


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an `Authorization` header is `Bearer <key>` (scheme case-insensitive, constant-time compare)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())
