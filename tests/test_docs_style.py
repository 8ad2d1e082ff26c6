"""The Markdown the site is built from reads right in a browser.

Defects that the build itself does not report:

- ``2**19`` written outside code: Markdown reads the two ``**`` as bold markers, and the
  rest of the paragraph comes out in bold with the exponent lost;
- code lines wider than 88 columns (in the pages' code blocks and in the example scripts, which
  the examples pages show in full): the page's code box is 88 columns wide, so such a block
  scrolls sideways and the end of its lines (often the comment that explains them) is hidden;
- sentences about how the project was built or measured ("the development machine"): a
  reader needs what to expect on their own hardware, and a benchmark states the machine and
  the command that produced its table, nothing more.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Every Markdown file the site shows: the guides, the files they include, the README (the
# front page), the changelog and the benchmark's pages.
SOURCES = sorted(
    {ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "benchmarks").glob("*.md")}
    | {p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts}
)
# Scripts the examples page shows in full.
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))
MAX_CODE_COLUMNS = 88

FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,}).*?^(?P=fence)[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(?<!`)(?P<ticks>`+)(?!`).+?(?<!`)(?P=ticks)(?!`)", re.S)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
DIGIT_BOLD = re.compile(r"\d\*\*-?\d")
HISTORY = [
    re.compile(p, re.I)
    for p in (
        r"development machine",
        r"idle machine",
        r"no GPU was available",
        r"quiet \d+-core machine",
        r"(?:the|our) \d+-core machine",
        r"was not available to (?:measure|this)",
    )
]


def prose(text: str) -> str:
    """``text`` without fenced code blocks, code spans and HTML comments."""
    return CODE_SPAN.sub("", HTML_COMMENT.sub("", FENCE.sub("", text)))


def digit_bold(text: str) -> list[str]:
    """The ``**`` between digits outside code (each with its surroundings)."""
    found = prose(text)
    return [found[max(m.start() - 20, 0) : m.end() + 20] for m in DIGIT_BOLD.finditer(found)]


def wide_code_lines(text: str) -> list[str]:
    """The lines of fenced code blocks wider than the page's code box."""
    lines = []
    for block in FENCE.finditer(text):
        body = block[0].splitlines()[1:-1]
        lines += [line for line in body if len(line) > MAX_CODE_COLUMNS]
    return lines


def history(text: str) -> list[str]:
    """Phrases about how the project was developed or measured."""
    return [m[0] for pattern in HISTORY for m in pattern.finditer(text)]


def _name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_checks_see_the_sources():
    names = {_name(p) for p in SOURCES}
    assert {"README.md", "CHANGELOG.md", "docs/core.md", "benchmarks/README.md"} <= names
    assert len(SCRIPTS) >= 5


def test_the_checks_catch_what_they_look_for():
    # Each detector on a defect it must report and on the correct form it must accept.
    assert digit_bold("a 2**19-token update, underflows below 2**-24")
    assert not digit_bold("a `2**19`-token update, ``2**-24``, 2^19, 2\\*\\*19, **bold** 2")
    assert not digit_bold("```python\nx = 2**19\n```\n")
    wide = "x" * (MAX_CODE_COLUMNS + 1)
    assert wide_code_lines(f"```text\n{wide}\n```\n") == [wide]
    assert wide_code_lines(f"```python\n{wide[:-1]}\n```\n{wide}\n") == []
    assert history("On the 2-core development machine, it took 5 s")
    assert history("No GPU was available to this benchmark.")
    assert history("On a quiet 2-core machine the run took 35 minutes")
    assert not history("Machine: x86_64, 2 CPUs (the header of results.md)")


@pytest.mark.parametrize("page", SOURCES, ids=_name)
def test_no_double_star_between_digits_outside_code(page):
    found = digit_bold(page.read_text())
    assert not found, f"{_name(page)}: write 2^19 or `2**19`, not bare 2**19: {found}"


@pytest.mark.parametrize("page", SOURCES, ids=_name)
def test_code_lines_fit_the_page(page):
    found = wide_code_lines(page.read_text())
    assert not found, f"{_name(page)}: {len(found)} code lines over {MAX_CODE_COLUMNS}: {found}"


@pytest.mark.parametrize("script", SCRIPTS, ids=_name)
def test_example_scripts_fit_the_page(script):
    # The examples pages show each script in full (examples/ruff.toml formats them so).
    found = [line for line in script.read_text().splitlines() if len(line) > MAX_CODE_COLUMNS]
    assert not found, f"{_name(script)}: {len(found)} lines over {MAX_CODE_COLUMNS}: {found}"


@pytest.mark.parametrize("page", SOURCES + SCRIPTS, ids=_name)
def test_no_development_history(page):
    found = history(page.read_text())
    assert not found, f"{_name(page)} says how the project was built: {found}"


def test_supported_versions_are_those_pyproject_declares():
    # The getting started page's table of versions, row for row against pyproject.toml.
    pyproject = (ROOT / "pyproject.toml").read_text()
    python = re.search(r'^requires-python = "([^"]+)"', pyproject, re.M)[1]
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)[1]
    declared = dict(re.findall(r'"([A-Za-z_.-]+)([<>=!~][^"]*)"', deps))
    assert {"jax", "jaxlib", "optax", "flax", "chex"} <= set(declared)
    page = (DOCS / "getting_started.md").read_text()
    rows = dict(re.findall(r"^\| ([\w, ]+) \| ([<>=!~][^|]*?) \|$", page, re.M))
    shown = {"python": rows.pop("Python")}
    for names, spec in rows.items():
        shown |= {name.strip(): spec for name in names.split(",")}
    assert shown == {"python": python, **declared}
