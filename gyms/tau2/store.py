"""tau2's database hash over gyms.tau's copy-on-write episode databases.

tau2 hashes `sha256(json.dumps(db.model_dump(), sort_keys=True, default=str))` (SPEC.md §2). Every database here
is a set of keyed tables, so that string is `{"<table>": {"<key>": <record>, ...}, ...}`: one fragment per record,
as for tau-bench's hash, and gyms.tau.store's incremental hashing applies with a JSON rendering of each fragment.
Records are held in the shape of the pydantic dump (every field, nulls included, in the model's field order), so
a tool's observation is `json.dumps(record)` and the hash needs no model.
"""

import hashlib
import json
from typing import Any

from gyms.tau.store import BaseTables, EpisodeDB, RenderedTable


def dump_sorted(value: Any) -> str:
    """The hash preimage of a value: key-sorted JSON, Python's separators, ASCII only, `str()` for the rest."""
    return json.dumps(value, sort_keys=True, default=str)


def _json_fragment(key: str, record: Any) -> bytes:
    return (json.dumps(key) + ": " + dump_sorted(record)).encode()


def _json_join(parts: list[bytes]) -> bytes:
    return b"{" + b", ".join(parts) + b"}"


class JsonRenderedTable(RenderedTable):
    """A base table rendered as the key-sorted JSON object tau2 hashes."""

    fragment = staticmethod(_json_fragment)
    join = staticmethod(_json_join)


class JsonBaseTables(BaseTables):
    """A domain's shared base, rendered for tau2's hash."""

    rendered_type = JsonRenderedTable


class Tau2DB(EpisodeDB):
    """One episode's database with tau2's hash (only the records the episode changed are re-rendered)."""

    def hash(self) -> str:
        h = hashlib.sha256(b"{")
        for i, name in enumerate(sorted(self.tables)):
            h.update(f"{', ' if i else ''}{json.dumps(name)}: ".encode())
            self.base.rendered(name).feed(h, self.tables[name].changed)
        h.update(b"}")
        return h.hexdigest()


def reference_hash(data: dict[str, Any]) -> str:
    """The hash of a fully materialised database (slow path, for tests)."""
    return hashlib.sha256(dump_sorted(data).encode()).hexdigest()
