"""The examples of the README and of docs/ run as written."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(doc.name, i, block) for doc in DOCS
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]


def test_docs_have_examples():
    assert sum(name == "README.md" for name, _, _ in BLOCKS) >= 2
    assert sum(name == "step_api.md" for name, _, _ in BLOCKS) >= 2


@pytest.mark.parametrize("name,index,block", BLOCKS, ids=[f"{n}:{i}" for n, i, _ in BLOCKS])
def test_doc_example_runs(name, index, block):
    exec(compile(block, f"{name} block {index}", "exec"), {})
