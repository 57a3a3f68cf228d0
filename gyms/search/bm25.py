"""The offline search backend: Okapi BM25 over a local corpus (a .jsonl file or a folder of text files).

A corpus is loaded and indexed once per process (per path and modification time), then shared by every
SearchGym instance.
"""

import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from userrl_megatron.errors import UserError

log = logging.getLogger(__name__)
_TOKEN = re.compile(r"[a-z0-9]+")


SNIPPET_CHARS = 400


@dataclass(frozen=True)
class Hit:
    title: str
    text: str
    label: str = "Snippet"  # UserRL's line label: "Snippet", or "Answer" for a web answer box's answer


def snippet(text: str) -> str:
    """A document's text as a search snippet: whitespace collapsed, cut at SNIPPET_CHARS characters + "..."."""
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "..."


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric tokens."""
    return _TOKEN.findall(text.lower())


class BM25Index:
    """BM25 (k1, b) over documents of (title, text); the title is indexed with the text."""

    def __init__(self, documents: list[Hit], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents = documents
        self.k1, self.b = k1, b
        terms = [Counter(tokenize(f"{d.title} {d.text}")) for d in documents]
        lengths = [sum(t.values()) for t in terms]
        avg_length = sum(lengths) / len(documents) if documents else 0.0
        self._norms = [k1 * (1 - b + b * length / avg_length) for length in lengths]
        # term -> [(document index, term frequency)]: a query touches only the documents holding its terms
        self._postings: dict[str, list[tuple[int, int]]] = {}
        for i, counts in enumerate(terms):
            for term, tf in counts.items():
                self._postings.setdefault(term, []).append((i, tf))
        n = len(documents)
        self._idf = {term: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for term, p in self._postings.items()}

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every document for `query` (a term repeated in the query counts as often).

        Work is linear in the query's length plus the postings of its distinct terms, however long the query.
        """
        out = [0.0] * len(self.documents)
        for term, count in Counter(t for t in tokenize(query) if t in self._idf).items():
            idf = self._idf[term]
            for i, tf in self._postings[term]:
                out[i] += count * idf * tf * (self.k1 + 1) / (tf + self._norms[i])
        return out

    def search(self, query: str, k: int) -> list[Hit]:
        """The `k` best documents with a positive score, best first (ties keep corpus order)."""
        scored = [(s, i) for i, s in enumerate(self.scores(query)) if s > 0]
        scored.sort(key=lambda pair: (-pair[0], pair[1]))
        return [self.documents[i] for _, i in scored[:k]]


class OfflineSearch:
    """Search backend over `corpus_path` (empty path: no documents, every search finds nothing)."""

    def __init__(self, corpus_path: str) -> None:
        if not corpus_path:
            _warn_no_corpus()
            self.index = BM25Index([])
        else:
            path = Path(corpus_path).expanduser().resolve()
            if not path.exists():
                raise UserError(f"gyms.search.corpus_path {corpus_path!r} does not exist")
            self.index = _index(path, path.stat().st_mtime_ns)

    async def search(self, query: str, k: int) -> list[Hit]:
        """The `k` best documents that have text, as snippets (UserRL skips a result without a snippet)."""
        hits: list[Hit] = []
        for doc in self.index.search(query, len(self.index.documents)):
            if len(hits) == k:
                break
            text = snippet(doc.text)
            if text:
                hits.append(Hit(doc.title, text))
        return hits


@cache
def _warn_no_corpus() -> None:
    log.warning("SearchGym offline backend has no corpus (gyms.search.corpus_path is empty): searches find nothing")


@lru_cache(maxsize=4)
def _index(path: Path, mtime_ns: int) -> BM25Index:
    return BM25Index(load_corpus(path))


def load_corpus(path: Path) -> list[Hit]:
    """Documents of a .jsonl file (`title` and `text` or `contents` per line) or a folder of .txt/.md files."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
        return [Hit(p.stem, p.read_text(encoding="utf-8", errors="replace")) for p in files]
    if path.suffix != ".jsonl":
        raise UserError(f"a search corpus is a .jsonl file or a folder of .txt/.md files, got {path}")
    documents = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                documents.append(Hit(str(row.get("title", "")), str(row.get("text", row.get("contents", "")))))
            except (json.JSONDecodeError, AttributeError) as e:
                raise UserError(f"{path}:{number}: not a JSON object with title and text ({e})") from e
    return documents
