"""The per-episode cache of an evaluation: one JSON line per finished episode, keyed by everything that can
change its result, so that an interrupted run resumes without redoing finished episodes and a changed setting
never reuses an old result.

The key hashes the policy's identity (weights fingerprint or endpoint and model name), the sampling settings,
the user simulator, the gym's settings, the task (id, prompt, tools, metadata) and the sample index. Lines are
appended and flushed one at a time: a run killed mid-write leaves at most one torn last line, which is ignored.
Episodes lost to the infrastructure are never cached (a resumed run tries them again).
"""

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_key(parts: dict[str, Any]) -> str:
    """A stable hash of `parts` (JSON with sorted keys)."""
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


class EpisodeCache:
    """Append-only JSONL store `key -> episode record` in `path`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        torn = 0
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    torn += 1  # the last line of a run killed while writing it
                    continue
                self.records[entry["key"]] = entry["record"]
        if torn:
            log.warning("%s: %d unreadable line(s) ignored (a run stopped while writing)", self.path, torn)
        if torn:  # rewrite without the torn line so that the next append starts a fresh line
            self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for key, record in self.records.items():
                f.write(json.dumps({"key": key, "record": record}, ensure_ascii=False) + "\n")
        tmp.replace(self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.records.get(key)

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Store and flush one finished episode."""
        self.records[key] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "record": record}, ensure_ascii=False) + "\n")
            f.flush()
