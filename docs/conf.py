"""Sphinx configuration: the guides (docs/*.md, README.md as the index) and the API reference.

``make docs`` builds the site into ``docs/_build/html``; ``tests/test_docs_site.py`` builds it
with warnings as errors, so a broken link or cross-reference or a public name without a
docstring fails the test suite.
"""

from __future__ import annotations

import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # the checkout's package, installed or not

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
    "apiref",
    "repolinks",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
templates_path: list[str] = []

# Markdown: GitHub-style heading anchors, so "page.md#a-heading" links resolve.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Repository files that are pages of the site (docs/_ext/repolinks.py rewrites links to them).
repolinks_pages = {
    "README.md": "index",
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

# Every reference to a name of this package must resolve; references to other
# libraries' names (jax.Array, optax.Params, builtins) are plain text here.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!lossscale_jax(\.|$)).*")]

html_theme = "furo"
html_title = f"lossscale_jax {release}"
html_static_path = ["_static"]
html_css_files = ["tables.css"]
html_show_sourcelink = False
