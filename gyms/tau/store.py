"""Copy-on-write episode databases over one shared, read-only base, and tau-bench's database hash.

A domain database is a few megabytes of JSON (retail 2.3 MB, airline 5 MB). tau-bench re-reads it for every
episode; a deep copy costs tens of milliseconds. Here the base is loaded once per process and every episode
gets an `EpisodeDB` whose tables hold only the records that episode changed: a fresh database costs a few
microseconds, and a tool that changes a record first takes a private copy of that one record (`Table.edit`).

The hash is tau-bench's: sha256 of Python's `str()` of the database turned into nested tuples (dicts become
key-sorted `(key, value)` pairs, lists become tuples). That string is a concatenation of one fragment per
record, so the fragments of the base are rendered once and an episode re-renders only the records it changed.
"""

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def to_hashable(value: Any) -> Any:
    """tau-bench's canonical form: dicts -> key-sorted tuples of (key, value), lists -> tuples, sets -> sorted."""
    if isinstance(value, dict):
        return tuple((k, to_hashable(v)) for k, v in sorted(value.items()))
    if isinstance(value, list):
        return tuple(to_hashable(v) for v in value)
    if isinstance(value, set):
        return tuple(sorted(to_hashable(v) for v in value))
    return value


def db_hash(data: dict[str, Any]) -> str:
    """The reference hash of a fully materialised database (slow path; `EpisodeDB.hash` is the fast one)."""
    return hashlib.sha256(str(to_hashable(data)).encode("utf-8")).hexdigest()


def _tuple_bytes(parts: list[bytes]) -> bytes:
    """UTF-8 `str()` of a tuple whose elements render as `parts` (a 1-tuple keeps its trailing comma)."""
    if len(parts) == 1:
        return b"(" + parts[0] + b",)"
    return b"(" + b", ".join(parts) + b")"


def _fragment(key: str, record: Any) -> bytes:
    """How one `(key, record)` pair of a table renders inside the hashed string."""
    return f"({key!r}, {to_hashable(record)!s})".encode()


def _clone(value: Any) -> Any:
    """Deep copy of JSON data (dicts, lists, scalars); much faster than `copy.deepcopy` on such data."""
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


class RenderedTable:
    """A base table rendered for hashing: the bytes, and where each record's fragment lies in them.

    `fragment` and `join` are tau-bench's rendering; a subclass may render otherwise (gyms.tau2: JSON), as long as
    the table opens with one byte and separates fragments with two.
    """

    fragment = staticmethod(_fragment)
    join = staticmethod(_tuple_bytes)

    def __init__(self, records: dict[str, Record]) -> None:
        self.keys = sorted(records)
        fragments = [self.fragment(k, records[k]) for k in self.keys]
        self.data = self.join(fragments)
        self.spans: dict[str, tuple[int, int]] = {}
        offset = 1  # after "("
        for key, fragment in zip(self.keys, fragments, strict=True):
            self.spans[key] = (offset, offset + len(fragment))
            offset += len(fragment) + 2  # ", "

    def feed(self, h: "hashlib._Hash", changed: dict[str, Record]) -> None:
        """Feed the table's rendering with `changed` records substituted into `h`."""
        if not changed:
            h.update(self.data)
        elif all(k in self.spans for k in changed):  # only edits: splice new fragments into the base bytes
            view, cursor = memoryview(self.data), 0
            for start, end, key in sorted((*self.spans[k], k) for k in changed):
                h.update(view[cursor:start])
                h.update(self.fragment(key, changed[key]))
                cursor = end
            h.update(view[cursor:])
        else:  # inserted records move the others: render the key order afresh
            parts = []
            for key in sorted([*self.keys, *(k for k in changed if k not in self.spans)]):
                if key in changed:
                    parts.append(self.fragment(key, changed[key]))
                else:
                    start, end = self.spans[key]
                    parts.append(self.data[start:end])
            h.update(self.join(parts))


class BaseTables:
    """The shared base of a domain: its tables as loaded from JSON, rendered for hashing on first use.

    Nothing may mutate these records; episodes read them through `Table` and copy before writing.
    """

    rendered_type: type[RenderedTable] = RenderedTable

    def __init__(self, tables: dict[str, dict[str, Record]]) -> None:
        self.tables = tables
        self._rendered: dict[str, RenderedTable] = {}
        self._hash: str | None = None

    @classmethod
    def from_json_files(cls, folder: Path, names: tuple[str, ...]) -> "BaseTables":
        """Load `<folder>/<name>.json` for each table name."""
        tables = {}
        for name in names:
            with open(folder / f"{name}.json", encoding="utf-8") as f:
                tables[name] = json.load(f)
        return cls(tables)

    def rendered(self, table: str) -> RenderedTable:
        """The hash rendering of a base table (built once)."""
        if table not in self._rendered:
            self._rendered[table] = self.rendered_type(self.tables[table])
        return self._rendered[table]

    def hash(self) -> str:
        """Hash of the unmodified base (equals `db_hash(self.tables)`)."""
        if self._hash is None:
            self._hash = EpisodeDB(self).hash()
        return self._hash


class Table:
    """One table of an episode: reads fall through to the base; `edit` and `insert` write privately.

    Iteration follows Python dict order of the equivalent deep copy: base order, then inserted ids.
    """

    __slots__ = ("_base", "_own")

    def __init__(self, base: dict[str, Record]) -> None:
        self._base = base
        self._own: dict[str, Record] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._own or key in self._base

    def __getitem__(self, key: str) -> Record:
        """The current record, read-only: use `edit` to change it."""
        record = self._own.get(key)
        return self._base[key] if record is None else record

    def __len__(self) -> int:
        return len(self._base) + sum(1 for k in self._own if k not in self._base)

    def edit(self, key: str) -> Record:
        """The episode's private, mutable copy of a record (copied from the base on first edit)."""
        record = self._own.get(key)
        if record is None:
            record = self._own[key] = _clone(self._base[key])
        return record

    def insert(self, key: str, record: Record) -> None:
        """Add a record, or replace one wholesale."""
        self._own[key] = record

    def keys(self) -> Iterator[str]:
        yield from self._base
        yield from (k for k in self._own if k not in self._base)

    def values(self) -> Iterator[Record]:
        for key in self.keys():
            yield self[key]

    def items(self) -> Iterator[tuple[str, Record]]:
        for key in self.keys():
            yield key, self[key]

    @property
    def changed(self) -> dict[str, Record]:
        """Records this episode edited or inserted."""
        return self._own


class EpisodeDB:
    """A fresh database for one episode: tables indexed by name (`db["orders"]`), isolated from every other."""

    def __init__(self, base: BaseTables) -> None:
        self.base = base
        self.tables = {name: Table(records) for name, records in base.tables.items()}

    def __getitem__(self, name: str) -> Table:
        return self.tables[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tables

    def hash(self) -> str:
        """tau-bench's hash of this episode's database, re-rendering only the records the episode changed."""
        names = sorted(self.tables)
        h = hashlib.sha256(b"(")
        for i, name in enumerate(names):
            h.update(f"{', ' if i else ''}({name!r}, ".encode())
            self.base.rendered(name).feed(h, self.tables[name].changed)
            h.update(b")")
        h.update(b",)" if len(names) == 1 else b")")
        return h.hexdigest()

    def to_dict(self) -> dict[str, dict[str, Record]]:
        """The whole database as plain dicts (shares unchanged records with the base: do not mutate)."""
        return {name: dict(table.items()) for name, table in self.tables.items()}
