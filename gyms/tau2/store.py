"""tau2's database hash over gyms.tau's copy-on-write episode databases.

tau2 hashes `sha256(json.dumps(db.model_dump(), sort_keys=True, default=str))` (SPEC.md §2). Every database here
is a set of tables, so that string is `{"<table>": <table>, ...}` with one fragment per record, as for tau-bench's
hash, and gyms.tau.store's incremental hashing applies with a JSON rendering of each fragment. A table has a shape:
- `object` (airline, retail, mock): records keyed by id, rendered `{"<key>": <record>, ...}`;
- `list` (telecom's plans, lines, ...): records keyed by their zero-padded position, rendered `[<record>, ...]`;
- `record` (telecom's device, surroundings): one record under the key `RECORD`, rendered as itself.
Records are held in the shape of the pydantic dump (every field, nulls included, in the model's field order), so
a tool's observation is `json.dumps(record)` and the hash needs no model.
"""

import hashlib
import json
from typing import Any, Literal

from gyms.tau.store import BaseTables, EpisodeDB, Record, RenderedTable

Shape = Literal["object", "list", "record"]
RECORD = ""


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


def _list_fragment(key: str, record: Any) -> bytes:
    return dump_sorted(record).encode()


def _list_join(parts: list[bytes]) -> bytes:
    return b"[" + b", ".join(parts) + b"]"


class JsonListTable(RenderedTable):
    """A base table tau2 holds as a list, rendered as a JSON array in key (position) order."""

    fragment = staticmethod(_list_fragment)
    join = staticmethod(_list_join)


class JsonRecordTable(RenderedTable):
    """A base table that is one object: its single record (key `RECORD`) rendered as itself."""

    def __init__(self, records: dict[str, Record]) -> None:
        self.keys = [RECORD]
        self.data = dump_sorted(records[RECORD]).encode()
        self.spans = {RECORD: (0, len(self.data))}

    def feed(self, h: "hashlib._Hash", changed: dict[str, Record]) -> None:
        h.update(dump_sorted(changed[RECORD]).encode() if changed else self.data)


RENDERED: dict[str, type[RenderedTable]] = {
    "object": JsonRenderedTable,
    "list": JsonListTable,
    "record": JsonRecordTable,
}


def position(index: int) -> str:
    """The key of a list table's record at `index` (zero-padded, so that key order is list order)."""
    return f"{index:06d}"


class JsonBaseTables(BaseTables):
    """A domain's shared base, rendered for tau2's hash; `shapes` names the tables that are not `object`."""

    rendered_type = JsonRenderedTable

    def __init__(self, tables: dict[str, dict[str, Record]], shapes: dict[str, Shape] | None = None) -> None:
        super().__init__(tables)
        self.shapes: dict[str, Shape] = {t: (shapes or {}).get(t, "object") for t in tables}

    def rendered(self, table: str) -> RenderedTable:
        if table not in self._rendered:
            self._rendered[table] = RENDERED[self.shapes[table]](self.tables[table])
        return self._rendered[table]


class Tau2DB(EpisodeDB):
    """One episode's database with tau2's hash (only the records the episode changed are re-rendered)."""

    def hash(self) -> str:
        h = hashlib.sha256(b"{")
        for i, name in enumerate(sorted(self.tables)):
            h.update(f"{', ' if i else ''}{json.dumps(name)}: ".encode())
            self.base.rendered(name).feed(h, self.tables[name].changed)
        h.update(b"}")
        return h.hexdigest()

    @property
    def shapes(self) -> dict[str, Shape]:
        return self.base.shapes if isinstance(self.base, JsonBaseTables) else {}

    def append(self, table: str, record: Record) -> None:
        """Add a record at the end of a `list` table."""
        self.tables[table].insert(position(len(self.tables[table])), record)

    def to_dict(self) -> dict[str, Any]:
        """The whole database as upstream dumps it (shares unchanged records with the base: do not mutate)."""
        shapes, out = self.shapes, {}
        for name, table in self.tables.items():
            shape = shapes.get(name, "object")
            out[name] = (
                list(table.values()) if shape == "list" else table[RECORD] if shape == "record" else dict(table.items())
            )
        return out


def reference_hash(data: dict[str, Any]) -> str:
    """The hash of a fully materialised database (slow path, for tests)."""
    return hashlib.sha256(dump_sorted(data).encode()).hexdigest()
