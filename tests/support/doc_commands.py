"""The command lines of README.md and docs/*.md, and a way to run the `userrl` ones in-process.

Which lines are commands (tests/unit/test_doc_commands.py runs or lists every one):

* Only fenced blocks (```, also indented under a list item) are read, whatever their info string, except
  ```python and ```yaml blocks: their lines are code and configuration, not shell.
* A block with lines starting with `$ ` is a transcript: each such line is a command (the text after `$ `), and
  the lines after it, up to the next `$ ` line or the end of the block, are what it prints (stdout and stderr as
  one stream, in order).
* In any other block, a line is a command when its first word is one of COMMAND_WORDS, unless it is a message
  (its first or second word ends with `:`, as in `userrl: error: ...` or `userrl slurm: ...`). Indented
  continuation lines of a syntax summary (`    --endpoint URL ...`) start with no command word and belong to
  the line above.
* A command's text is the line without a trailing `# comment`, with runs of whitespace made one space: the same
  command aligned differently in two pages is one command.
"""

import contextlib
import glob
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMAND_WORDS = ("userrl", "make", "python", "python3", "sbatch", "srun", "pytest", "pip", "bash", ".venv/bin/")
CODE_BLOCKS = ("python", "yaml")
FENCE = re.compile(r"^\s*```\s*(\S*)")
COMMENT = re.compile(r"(^|\s)#.*$")


@dataclass(frozen=True)
class DocCommand:
    """One command line of a page: its text, where it is, and the output shown under it (transcripts only)."""

    text: str
    doc: str
    line: int
    output: tuple[str, ...] | None


def doc_pages() -> list[Path]:
    """README.md, then docs/*.md in name order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def normalise(line: str) -> str:
    """A command's text: no trailing `# comment`, whitespace runs made one space."""
    return " ".join(COMMENT.sub("", line).split())


def is_command(line: str) -> bool:
    """Whether a line of a non-transcript block starts with a command word and is not a message."""
    words = line.split()
    if not words or any(word.endswith(":") for word in words[:2]):
        return False
    return any(words[0] == w or (w.endswith("/") and words[0].startswith(w)) for w in COMMAND_WORDS)


def _block_commands(block: list[tuple[int, str]], doc: str, indent: int) -> list[DocCommand]:
    """The commands of one fenced block (its lines with their 1-based line numbers; the fence indented `indent`)."""
    if not any(text.lstrip().startswith("$ ") for _, text in block):
        return [DocCommand(normalise(t), doc, n, None) for n, t in block if is_command(t)]
    commands: list[DocCommand] = []
    current: tuple[int, str] | None = None
    output: list[str] = []
    for number, text in [*block, (0, "$ ")]:
        if text.lstrip().startswith("$ "):
            if current is not None:
                commands.append(DocCommand(normalise(current[1]), doc, current[0], tuple(output)))
            current, output = (number, text.lstrip()[2:]), []
        elif current is not None:
            output.append(text[indent:].rstrip())
    return commands


def page_commands(text: str, doc: str) -> list[DocCommand]:
    """The command lines of one page's text, in line order."""
    found: list[DocCommand] = []
    block: list[tuple[int, str]] | None = None
    info, indent = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if block is None:
            if fence:
                block, info, indent = [], fence.group(1), len(line) - len(line.lstrip())
        elif fence:
            if info not in CODE_BLOCKS:
                found += _block_commands(block, doc, indent)
            block = None
        else:
            block.append((number, line))
    return found


def doc_commands() -> list[DocCommand]:
    """Every command line of the pages, in page then line order."""
    return [c for page in doc_pages() for c in page_commands(page.read_text(), page.relative_to(REPO).as_posix())]


def userrl_argv(command: str) -> list[str]:
    """`userrl ...` as the argument list a shell in the repository root would pass (globs expanded)."""
    words = shlex.split(command)
    assert words[0] == "userrl", command
    argv: list[str] = []
    for word in words[1:]:
        matches = sorted(glob.glob(word, root_dir=REPO)) if any(c in word for c in "*?[") else []
        argv += matches or [word]
    return argv


def run_userrl(command: str) -> tuple[int, list[str]]:
    """Run a `userrl` command line in this process from the repository root: exit status and printed lines.

    stdout and stderr go to one stream, as a terminal shows them. The caller sets the working directory.
    """
    from userrl_megatron.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            status = main(userrl_argv(command))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, printed.getvalue().splitlines()
