"""tools/doc_sentences.py's counting on a small page: what is skipped, where sentences end, what a word is."""

import json
from pathlib import Path

from tests.support.tools import load_tool

PAGE = """# A heading is skipped

The engine serves tokens. It answers in `/generate` form, e.g. with log-probs, and see [the docs](docs/engine.md).
A line break does not end a sentence
- a list item is its own sentence without a period
- two sentences here. Yes!

| a table | is skipped |
|---|---|
| 1 | 2 |

```bash
make test   # code is skipped. Entirely.
```

<!-- a comment. Skipped. -->
> Quoted text counts? It does. ![an image](x.png)
"""


def test_counts_prose_and_list_items_only() -> None:
    tool = load_tool("doc_sentences")
    got = [tool.sentences(b) for b in tool.blocks(PAGE)]
    assert got == [
        [
            "The engine serves tokens.",
            "It answers in CODE form, e.g. with log-probs, and see the docs.",
            "A line break does not end a sentence",
        ],
        ["a list item is its own sentence without a period"],
        ["two sentences here.", "Yes!"],
        ["Quoted text counts?", "It does. "],
    ]
    count = tool.count(PAGE)
    # 4 + 12 + 8 + 10 + 3 + 1 + 3 + 2 words over 8 sentences
    assert (count.words, count.sentences) == (43, 8)
    assert count.average == 43 / 8


def test_command_line_prints_and_writes_json(tmp_path: Path, capsys) -> None:
    tool = load_tool("doc_sentences")
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    out = tmp_path / "counts.json"
    assert tool.main([str(page), "--json", str(out)]) == 0
    assert capsys.readouterr().out == f"{page}: 5.4 words/sentence (43 words, 8 sentences)\n"
    assert json.loads(out.read_text()) == {str(page): {"words": 43, "sentences": 8, "average": 5.38}}
    assert tool.main([str(page), "--max", "5"]) == 1
