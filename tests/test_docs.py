"""Every ```python block of README.md and docs/*.md runs, in order, one namespace per file;
the troubleshooting page's entries also run each on its own setup.

A ```diff block shows a program before and after a change (lines starting ``-`` are only in
the first, ``+`` only in the second, `` `` in both): both programs run, each on its own.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
from helpers import ROOT  # tests/ is on sys.path under pytest

# Slow (make test-fast leaves it out): every page's code blocks (about 35 s of test time).
pytestmark = pytest.mark.slow

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
DIFF = re.compile(r"^```diff\n(.*?)^```", re.S | re.M)


def python_blocks(path: pathlib.Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_pages_have_code():
    assert python_blocks(ROOT / "README.md"), "README.md must show runnable code"
    assert all((ROOT / "docs" / name).is_file() for name in MULTIDEVICE_PAGES)


# Pages whose blocks map over 8 devices of the default backend (they say so, and set 8 CPU
# devices on a CPU-only machine): skipped, with the reason, where the backend has fewer
# (conftest.py; make test-gpu on a one-GPU machine).
MULTIDEVICE_PAGES = ("data_parallel.md",)
# Pages whose blocks run a program of an optional integration: skipped, with the reason, where
# it is not installed (make test-tunix runs them in its venv).
TUNIX_PAGES = ("rl.md",)
HAVE_TUNIX = importlib.util.find_spec("tunix") is not None
EASYDEL_PAGES = ("easydel.md",)  # make test-easydel runs them in its venv
HAVE_EASYDEL = importlib.util.find_spec("easydel") is not None


def _marks(page: pathlib.Path) -> list:
    marks = [pytest.mark.multidevice(8)] if page.name in MULTIDEVICE_PAGES else []
    if page.name in TUNIX_PAGES:
        reason = "needs google-tunix (an optional integration: make test-tunix runs it)"
        marks.append(pytest.mark.skipif(not HAVE_TUNIX, reason=reason))
    if page.name in EASYDEL_PAGES:
        reason = "needs easydel (an optional integration: make test-easydel runs it)"
        marks.append(pytest.mark.skipif(not HAVE_EASYDEL, reason=reason))
    return marks


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=_marks(p)) for p in PAGES],
    ids=lambda p: p.name,
)
def test_code_blocks_run(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        try:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block {i} failed: {e!r}\n{block}") from e


def diff_programs(diff: str) -> tuple[str, str]:
    """The program before and after the change a ```diff block shows."""
    lines = diff.splitlines()
    bad = [line for line in lines if line and line[0] not in " +-"]
    assert not bad, f"diff lines must start with ' ', '+' or '-': {bad}"
    before = [line[1:] for line in lines if not line.startswith("+")]
    after = [line[1:] for line in lines if not line.startswith("-")]
    return "\n".join(before) + "\n", "\n".join(after) + "\n"


DIFFS = [(page, i) for page in PAGES for i, _ in enumerate(DIFF.findall(page.read_text()))]


def test_diff_programs_splits_the_two_sides():
    before, after = diff_programs(" a = 1\n-b = 2\n+b = 3\n+c = 4\n")
    assert (before, after) == ("a = 1\nb = 2\n", "a = 1\nb = 3\nc = 4\n")
    assert len(DIFFS) >= 3  # getting_started.md: Optax, Flax TrainState, NNX


@pytest.mark.parametrize("page,index", DIFFS, ids=lambda x: getattr(x, "name", str(x)))
def test_diff_blocks_run_before_and_after(page, index):
    diff = DIFF.findall(page.read_text())[index]
    for side, program in zip(("before", "after"), diff_programs(diff), strict=True):
        name = f"{page.name}[diff {index}, {side}]"
        try:
            exec(compile(program, name, "exec"), {"__name__": f"docs_{page.stem}_diff"})
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{name} failed: {e!r}\n{program}") from e


# Pages whose entries a reader copies one at a time: each block after the first runs on the
# first block (the page's shared setup) alone, not on what the blocks before it left behind.
SELF_CONTAINED = [ROOT / "docs" / "faq.md"]


@pytest.mark.parametrize("page", SELF_CONTAINED, ids=lambda p: p.name)
def test_each_entry_runs_on_the_shared_setup_alone(page):
    setup, *entries = python_blocks(page)
    for i, block in enumerate(entries, start=1):
        namespace: dict = {"__name__": f"docs_{page.stem}_entry"}
        exec(compile(setup, f"{page.name}[block 0]", "exec"), namespace)
        try:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block {i} failed on the setup alone: {e!r}") from e
