"""Every ```python block of README.md and docs/*.md runs, in order, one namespace per file."""

from __future__ import annotations

import pathlib
import re

import pytest
from helpers import ROOT  # tests/ is on sys.path under pytest

# Slow (make test-fast leaves it out): every page's code blocks (about 35 s of test time).
pytestmark = pytest.mark.slow

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: pathlib.Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_pages_have_code():
    assert python_blocks(ROOT / "README.md"), "README.md must show runnable code"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_blocks_run(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        try:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block {i} failed: {e!r}\n{block}") from e
