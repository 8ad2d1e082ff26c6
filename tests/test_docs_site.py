"""The documentation site builds with no warning, and its links and API reference are whole.

The build is the one ``make docs`` runs (Sphinx, ``-n -W --keep-going``), into a temporary
directory. A second, small build shows that the checks fail when they should: a broken
cross-reference, a broken link and a public name without a docstring each stop the build.
"""

from __future__ import annotations

import html.parser
import importlib.util
import inspect
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types
import urllib.parse

import pytest
from helpers import ROOT  # tests/ is on sys.path under pytest

import lossscale_jax
from lossscale_jax import compat, testing

# Slow (make test-fast leaves it out): the documentation site built with Sphinx.
pytestmark = pytest.mark.slow

DOCS = ROOT / "docs"
SPHINX_FLAGS = ["-n", "-W", "--keep-going", "-q", "-E"]


# The Makefile's virtual environment (make test, and CI through .ci/run) is built from the
# test extra, which has Sphinx: there a missing Sphinx fails these tests. Elsewhere (make
# test-gpu runs the suite in the machine's own Python, which may have none) they skip, saying
# why.
MAKEFILE_VENV = ROOT / ".venv"


def sphinx_runs() -> bool:
    """Whether ``python -m sphinx`` can run here (a ``sphinx`` that is not Sphinx, such as a
    namespace package, cannot)."""
    try:
        return importlib.util.find_spec("sphinx.__main__") is not None
    except ModuleNotFoundError:
        return False


def require_sphinx() -> None:
    """Fails in the Makefile's environment, skips elsewhere, where Sphinx cannot run."""
    if sphinx_runs():
        return
    if pathlib.Path(sys.prefix).resolve() == MAKEFILE_VENV.resolve():
        pytest.fail(f"Sphinx is missing from {sys.prefix}, which the test extra should have")
    pytest.skip(f"Sphinx is not installed for {sys.executable} (make test's environment has it)")


def sphinx_build(srcdir: pathlib.Path, outdir: pathlib.Path) -> subprocess.CompletedProcess:
    require_sphinx()
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", *SPHINX_FLAGS, str(srcdir), str(outdir)]
        + ["-d", str(outdir / ".doctrees")],
        capture_output=True,
        text=True,
        timeout=300,
    )


class Page(html.parser.HTMLParser):
    """The ids and the link targets of one built page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"])
        if tag == "a" and found.get("href"):
            self.hrefs.append(found["href"])


def parse(path: pathlib.Path) -> Page:
    page = Page()
    page.feed(path.read_text())
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    result = sphinx_build(DOCS, out)
    assert result.returncode == 0, f"docs build failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_site_builds_without_warnings(site):
    assert (site / "index.html").is_file()
    assert (site / "api" / "lossscale_jax.html").is_file()


def test_every_guide_page_is_in_the_site(site):
    for page in DOCS.glob("*.md"):
        assert (site / f"{page.stem}.html").is_file(), page.name


def test_every_relative_link_resolves(site):
    pages = {path: parse(path) for path in site.rglob("*.html")}
    checked = 0
    for path, page in pages.items():
        for href in page.hrefs:
            parts = urllib.parse.urlsplit(href)
            if parts.scheme or parts.netloc or not (parts.path or parts.fragment):
                continue
            target = (path.parent / urllib.parse.unquote(parts.path)).resolve()
            if not parts.path:
                target = path
            assert target.is_file(), f"{path.relative_to(site)} links to a missing {href}"
            if parts.fragment and target.suffix == ".html":
                assert parts.fragment in pages[target].ids, f"{path.name}: {href}"
            checked += 1
    assert checked > 500  # the sidebar alone links every page from every page


def test_readme_is_the_index_with_its_links_rewritten(site):
    hrefs = parse(site / "index.html").hrefs
    # README.md links docs/core.md and benchmarks/README.md, as the repository shows them.
    assert "core.html" in hrefs and "benchmarks.html" in hrefs
    assert {"getting_started.html", "examples.html", "faq.html", "changelog.html"} <= set(hrefs)
    assert not [h for h in hrefs if h.startswith("docs/") or h.endswith(".md")]
    # A repository file that is no page (the licence) is a copy the site carries.
    assert any(h.startswith("_downloads/") and h.endswith("/LICENSE") for h in hrefs)
    # Test names are not links: a link would download a whole test file.
    for page in site.rglob("*.html"):
        assert not [h for h in parse(page).hrefs if "/test_" in h and h.endswith(".py")], page


class Titles(html.parser.HTMLParser):
    """The <title> of a page and the captions of its navigation, with the links under each."""

    def __init__(self) -> None:
        super().__init__()
        self.title = ""
        self.captions: dict[str, list[str]] = {}
        self._in: str | None = None
        self._caption: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "title" and not self.title:
            self._in = "title"
        elif tag == "span" and found.get("class") == "caption-text":
            self._in = "caption"
        elif tag == "a" and self._caption and "reference internal" in (found.get("class") or ""):
            self.captions[self._caption].append(found.get("href") or "")

    def handle_data(self, data: str) -> None:
        if self._in == "title":
            self.title += data
        elif self._in == "caption":
            self._caption = data.strip()
            self.captions[self._caption] = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("title", "span"):
            self._in = None
        if tag == "div" and self._caption:  # the sidebar's tree ends with its <div>
            self._caption = None


def titles(path: pathlib.Path) -> Titles:
    parser = Titles()
    parser.feed(path.read_text())
    return parser


def test_every_page_has_a_title_of_its_own(site):
    found: dict[str, list[str]] = {}
    for page in site.rglob("*.html"):
        if page.name not in ("genindex.html", "search.html", "py-modindex.html"):
            found.setdefault(titles(page).title, []).append(str(page.relative_to(site)))
    assert len(found) > 20
    assert not {t: pages for t, pages in found.items() if len(pages) > 1}


def test_navigation_is_grouped(site):
    captions = titles(site / "index.html").captions
    assert list(captions) == ["Getting started", "Guides", "Background", "Reference"]
    first = ["getting_started.html", "examples.html", "faq.html"]
    assert [h for h in captions["Getting started"] if h in first] == first
    assert "examples/train_gpt.html" in captions["Getting started"]  # each example's page
    assert "performance.html" in captions["Background"]
    assert {"api/lossscale_jax.html", "changelog.html", "contributing.html"} <= set(
        captions["Reference"]
    )


def test_guides_link_names_to_the_api_reference_and_to_other_libraries(site):
    api = "api/lossscale_jax.html#lossscale_jax."
    core = parse(site / "core.html").hrefs
    assert f"{api}get_loss_scale_state" in core and f"{api}switch_policy" in core
    faq = set(parse(site / "faq.html").hrefs)
    for name in ("metrics", "overflowed_leaves", "check_checkpoint", "diagnose"):
        assert f"{api}{name}" in faq, name
    porting = set(parse(site / "porting.html").hrefs)
    assert "api/compat.html#lossscale_jax.compat.torch.GradScaler" in porting
    assert "https://optax.readthedocs.io/en/latest/api/generated/optax.chain.html#optax.chain" in (
        set(core)
    )
    assert "https://docs.jax.dev/en/latest/_autosummary/jax.lax.cond.html#jax.lax.cond" in (
        set(parse(site / "performance.html").hrefs)
    )
    # Every guide links the package's names: count the links into the API reference.
    links = sum(h.startswith("api/") for page in site.glob("*.html") for h in parse(page).hrefs)
    assert links > 300


def test_inventories_are_those_the_script_writes():
    sys.path.insert(0, str(DOCS / "_inventories"))
    try:
        import make_inventories
    finally:
        sys.path.remove(str(DOCS / "_inventories"))
    for project in make_inventories.PROJECTS:
        written = (DOCS / "_inventories" / f"{project}.inv").read_bytes()
        assert written == make_inventories.inventory(project), project


def test_an_architecture_page_goes_under_background(site, tmp_path):
    # docs/architecture.md is a page the navigation has a place for, first under Background.
    if (DOCS / "architecture.md").exists():  # the site built above has it: no second build
        captions = titles(site / "index.html").captions
        assert captions["Background"][0] == "architecture.html"
        return
    src = tmp_path / "docs"
    shutil.copytree(DOCS, src, ignore=shutil.ignore_patterns("_build"))
    for name in ("README.md", "CHANGELOG.md", "LICENSE"):  # the files the pages include
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("examples", "benchmarks"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "architecture.md").write_text("# How the package is laid out\n\nModules.\n")
    result = sphinx_build(src, tmp_path / "html")
    assert result.returncode == 0, result.stdout + result.stderr
    captions = titles(tmp_path / "html" / "index.html").captions
    assert captions["Background"][0] == "architecture.html"


def _public_paths() -> set[str]:
    """Every public name the API reference must show, computed from the package."""
    paths = {f"lossscale_jax.{n}" for n in lossscale_jax.__all__}
    # pages of their own
    own_pages = ("compat", "testing", "errors", "taps", "layerwise", "presets")
    paths -= {f"lossscale_jax.{n}" for n in own_pages}
    paths |= {f"lossscale_jax.taps.{n}" for n in lossscale_jax.taps.__all__}
    paths |= {f"lossscale_jax.layerwise.{n}" for n in lossscale_jax.layerwise.__all__}
    for namespace in compat.__all__:
        obj = getattr(compat, namespace)
        members = (
            obj.__all__
            if isinstance(obj, types.ModuleType)
            else [n for n, v in vars(obj).items() if not n.startswith("_") and callable(v)]
        )
        paths |= {f"lossscale_jax.compat.{namespace}.{m}" for m in members}
    paths |= {f"lossscale_jax.testing.{n}" for n in testing.__all__}
    paths |= {f"lossscale_jax.presets.{n}" for n in lossscale_jax.presets.__all__}
    paths |= {f"lossscale_jax.errors.{n}" for n in lossscale_jax.errors.__all__}
    for name in lossscale_jax.__all__:
        obj = getattr(lossscale_jax, name)
        if inspect.isclass(obj):
            paths |= {
                f"lossscale_jax.{name}.{m}"
                for m, v in vars(obj).items()
                if not m.startswith("_")
                and inspect.isfunction(v)
                and "lossscale_jax" in v.__module__
            }
    return paths


def test_api_reference_shows_every_public_name(site):
    ids = set()
    for page in (site / "api").glob("*.html"):
        ids |= parse(page).ids
    missing = sorted(_public_paths() - ids)
    assert not missing, f"not in the API reference: {missing}"


def test_checks_fail_on_broken_references_and_missing_docstrings(tmp_path):
    # A small site with the real configuration and extensions, and one defect of each kind.
    src = tmp_path / "docs"
    shutil.copytree(DOCS, src, ignore=shutil.ignore_patterns("_build", "*.md", "api"))
    (tmp_path / "lsj_defects.py").write_text(
        textwrap.dedent(
            '''
            """A module with a public function that has no docstring."""

            __all__ = ["documented", "undocumented", "Holder"]


            def documented():
                """Has a docstring."""


            def undocumented():
                pass


            class Holder:
                """A class whose public method has no docstring."""

                def method(self):
                    pass
            '''
        )
    )
    (src / "index.md").write_text(
        "# Defects\n\nSee [a page that does not exist](missing.md).\n\n"
        "```{toctree}\napi/defects\n```\n"
    )
    (src / "api").mkdir()
    (src / "api" / "defects.rst").write_text(
        "Defects\n=======\n\n"
        "A reference to :func:`lossscale_jax.no_such_function`.\n\n"
        ".. api:: lsj_defects\n"
    )
    # conf.py puts its parent directory (here tmp_path) on sys.path: lsj_defects imports.
    result = sphinx_build(src, tmp_path / "html")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    for expected in (
        "py:func reference target not found: lossscale_jax.no_such_function",
        "missing.md",
        "lsj_defects.undocumented is public but has no docstring",
        "lsj_defects.Holder.method is public but has no docstring",
    ):
        assert expected in output, f"{expected!r} not reported:\n{output}"
    assert "lsj_defects.documented " not in output
