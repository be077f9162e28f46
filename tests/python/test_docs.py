"""The Python snippets of README.md, docs/python.md and docs/stacks.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def snippets(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), flags=re.S)


@pytest.mark.parametrize("path", ["README.md", "docs/python.md", "docs/stacks.md"])
def test_snippets_run(path):
    if path == "docs/stacks.md":
        pytest.importorskip("torchtitan.models.moe.moe", reason="torchtitan 0.2.2 is not installed")
    found = snippets(path)
    assert found, f"no python snippet in {path}"
    for code in found:
        exec(compile(code, f"{path} snippet", "exec"), {})
