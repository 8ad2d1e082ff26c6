"""Sphinx configuration: the guides (docs/*.md, README.md on the front page) and the API reference.

``make docs`` builds the site into ``docs/_build/html``; ``tests/test_docs_site.py`` builds it
with warnings as errors, so a broken link or cross-reference or a public name without a
docstring fails the test suite.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS / "_inventories"))
sys.path.insert(0, str(DOCS.parent))  # the checkout's package, installed or not

from make_inventories import PROJECTS  # noqa: E402

import lossscale_jax  # noqa: E402

project = "lossscale_jax"
author = "The lossscale_jax authors"
copyright = "the lossscale_jax authors"
release = version = lossscale_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx_copybutton",
    "apiref",
    "namelinks",
    "repolinks",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories"]
templates_path: list[str] = []

# Markdown: GitHub-style heading anchors, so "page.md#a-heading" links resolve.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Repository files that are pages of the site (docs/_ext/repolinks.py rewrites links to them).
repolinks_pages = {
    "README.md": "index",
    "CHANGELOG.md": "changelog",
    "benchmarks/README.md": "benchmarks",
    "benchmarks/results.md": "benchmark_results",
}

# API reference (docs/api/*.rst, generated from each module's __all__ by docs/_ext/apiref.py).
autodoc_member_order = "bysource"
# Types next to each documented argument, so signatures stay short (defaults visible) and
# aliases that other libraries expand into long unions (optax.OptState) stay out of them.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# jax.typing.ArrayLike by name, not expanded into its eight-member union.
autodoc_type_aliases = {"ArrayLike": "jax.typing.ArrayLike"}
autosummary_generate = False
# The page's table of contents lists members under their class by their own name ("scale",
# not "LossScaleState.scale"): qualified names broke mid-word in the narrow sidebar.
toc_object_entries_show_parents = "hide"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = False  # the Attributes text says the dtype
python_maximum_signature_line_length = 88
add_module_names = False

# Every reference to a name of this package must resolve; references to other libraries'
# names (jax.Array, optax.Params) link to their documentation where the inventories below
# list them, and are plain text otherwise.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!lossscale_jax(\.|$)).*")]

# jax, optax, flax and chex names link to those libraries' documentation. The inventories are
# files of this directory (docs/_inventories/make_inventories.py writes them), so the build
# needs no network.
intersphinx_mapping = {
    name: (root, str(DOCS / "_inventories" / f"{name}.inv")) for name, (root, _) in PROJECTS.items()
}

# Copy buttons on code blocks copy the code without the prompts (>>>, ...) and the printed
# output of docstring examples.
copybutton_exclude = ".linenos, .gp, .go"
# Before/after diffs (getting started) get no copy button: their "+" and "-" markers do not
# paste as Python; the runnable program after each diff has one.
copybutton_selector = "div:not(.highlight-diff) > div.highlight pre"


html_theme = "furo"
html_title = f"lossscale_jax {release}"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_show_sourcelink = False


# A slot in the navigation: "How the package is laid out" (docs/architecture.md), when it
# exists, is the first page of the Background section.
SLOTS = {"Background": ["architecture"]}


def _fill_slots(app: Any, docname: str, source: list[str]) -> None:
    if docname != "index":
        return
    for caption, pages in SLOTS.items():
        present = "".join(f"{p}\n" for p in pages if (DOCS / f"{p}.md").exists())
        source[0] = source[0].replace(
            f":caption: {caption}\n\n", f":caption: {caption}\n\n{present}"
        )


def setup(app: Any) -> None:
    app.connect("source-read", _fill_slots)
