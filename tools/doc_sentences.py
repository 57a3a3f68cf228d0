"""Average words per sentence of Markdown pages: the readability target of the reference docs (under 25).

    python tools/doc_sentences.py docs/trainer.md docs/rollout.md [--json OUT.json] [--max 25]

What counts: prose paragraphs and list items. What is skipped: fenced code blocks, tables (lines starting with
`|`), headings, HTML comments and block quotes' `>` markers (their text counts). Inside the prose, a link counts as
its text, an image as nothing, and an inline code span as one word. A sentence ends at `.`, `!` or `?` followed by
a space and a character that is not a lowercase letter (so "e.g. a" and "i.e. the" do not split), and at the end
of a paragraph or list item. A word is a whitespace-separated token holding a letter or a digit.

Prints one line per file; `--json` also writes {path: {"words", "sentences", "average"}}; `--max N` exits 1 when
a file's average is above N.
"""

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+")
IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
CODE = re.compile(r"`+[^`]*`+")
COMMENT = re.compile(r"<!--.*?-->", re.S)
SENTENCE_END = re.compile(r"(?<=[.!?])[)\"'*_]*\s+(?=[^a-z\s])")
WORD = re.compile(r"[A-Za-z0-9]")


@dataclass(frozen=True)
class Count:
    words: int
    sentences: int

    @property
    def average(self) -> float:
        return self.words / self.sentences if self.sentences else 0.0


def blocks(text: str) -> list[str]:
    """The prose of a Markdown page: one string per paragraph or list item."""
    out: list[str] = []
    current: list[str] = []
    in_code = False

    def flush() -> None:
        if current:
            out.append(" ".join(current))
            current.clear()

    for line in COMMENT.sub("", text).splitlines():
        if FENCE.match(line):
            flush()
            in_code = not in_code
            continue
        stripped = line.strip()
        if in_code or not stripped or stripped.startswith(("|", "#")):
            flush()
            continue
        stripped = stripped.lstrip("> ").strip()
        if LIST_ITEM.match(stripped):
            flush()
            stripped = LIST_ITEM.sub("", stripped, count=1)
        current.append(stripped)
    flush()
    return out


def clean(block: str) -> str:
    """Images dropped, links as their text, inline code as one token."""
    return CODE.sub("CODE", LINK.sub(r"\1", IMAGE.sub("", block)))


def sentences(block: str) -> list[str]:
    """The sentences of one paragraph or list item, each with at least one word."""
    parts = SENTENCE_END.split(clean(block))
    return [p for p in parts if any(WORD.search(w) for w in p.split())]


def count(text: str) -> Count:
    words = n = 0
    for block in blocks(text):
        for sentence in sentences(block):
            n += 1
            words += sum(1 for w in sentence.split() if WORD.search(w))
    return Count(words, n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the counts to this JSON file")
    parser.add_argument("--max", type=float, help="exit 1 when a file's average words per sentence is above this")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    over = []
    for path in args.files:
        c = count(path.read_text(encoding="utf-8"))
        results[str(path)] = {**asdict(c), "average": round(c.average, 2)}
        print(f"{path}: {c.average:.1f} words/sentence ({c.words} words, {c.sentences} sentences)")
        if args.max is not None and c.average > args.max:
            over.append(str(path))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if over:
        print(f"above {args.max:g} words/sentence: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
