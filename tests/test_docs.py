"""Every ```python block in docs/*.md runs: per file, in order, in one fresh namespace.

Blocks fenced with any other language (```text, ```bash, ...) or with none are not run, nor are ```python vllm
blocks (they start a vLLM engine: tests/vllm runs them, in the environment with vLLM). Files added to docs/ later
are picked up automatically.
"""

import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
RUN = {"python", "py", "python3"}
#: a word in a block's info string that leaves it to tests/vllm (```python vllm: it needs vLLM and starts an engine)
ENGINE = "vllm"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ``python`` fenced blocks of a markdown text, as ``(first line number, code)``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m["fence"], m["lang"].lower(), i + 1
        i += 1
        while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[i]):
            i += 1
        if lang in RUN and ENGINE not in lines[start - 1].split()[1:]:
            blocks.append((start + 1, textwrap.dedent("\n".join(lines[start:i]))))
        i += 1
    return blocks


def test_engine_blocks_are_left_to_the_vllm_tests():
    assert python_blocks("```python vllm\nLLM()\n```\n```python\nx = 1\n```\n") == [(5, "x = 1")]


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_fence_parser():
    text = "a\n```python\nx = 1\n```\n```text\nnot code\n```\n  ```py\n  y = x\n  ```\n````python\nz = '```'\n````\n"
    assert python_blocks(text) == [(3, "x = 1"), (9, "y = x"), (12, "z = '```'")]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.name)
def test_doc_code_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace = {"__name__": f"docs.{path.stem}"}
    for line, code in python_blocks(path.read_text(encoding="utf-8")):
        padded = "\n" * (line - 1) + code  # tracebacks point at the markdown file's own line numbers
        try:
            exec(compile(padded, str(path), "exec"), namespace)
        except Exception as e:  # a server tests/servers.py cannot start here (nginx not installed): as its tests do
            if type(e).__name__ == "ServerUnavailable":
                pytest.skip(f"{path.name}, block at line {line}: {e}")
            raise


def test_every_test_a_doc_names_exists():
    """``test_file.py::test_name`` references in docs (e.g. loading.md's promises) point at real tests."""
    tests = {p.name: p for p in Path(__file__).resolve().parent.rglob("test_*.py")}  # tests/vllm's too
    named = {m.groups() for path in doc_files() for m in re.finditer(r"`(test_\w+\.py)::(test_\w+)`", path.read_text())}
    assert len(named) >= 20  # the promises table of loading.md alone names more
    missing = [
        f"{file}::{name}"
        for file, name in sorted(named)
        if file not in tests or not re.search(rf"^def {name}\(", tests[file].read_text(), re.M)
    ]
    assert not missing, missing
