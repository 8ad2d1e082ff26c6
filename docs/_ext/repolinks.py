"""Relative links of the repository's Markdown files, resolved for the site.

The pages are written to be read on the repository: ``README.md`` links ``docs/core.md``,
``docs/performance.md`` links ``../benchmarks/README.md`` and ``../tests/test_compat.py``.
Before MyST parses a page (``source-read``) or a file it includes (``include-read``), each
relative link ``[text](path#anchor)`` outside code blocks is rewritten, relative to the
document being built:

- a page of the site (a Markdown file under the source directory, or a file that
  ``repolinks_pages`` maps to a page, such as ``benchmarks/README.md``) -> that page;
- another file of the repository -> the file (MyST makes it a download link: the built site
  carries a copy);
- a directory -> its text, unlinked (a site has no directory listings);
- anything else is left alone, and MyST warns about it (an error under ``-W``).
"""

from __future__ import annotations

import os
import pathlib
import re
import urllib.parse
from typing import Any

from sphinx.application import Sphinx

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")


def rewrite(
    text: str,
    file_dir: pathlib.Path,
    doc_dir: pathlib.Path,
    pages: dict[pathlib.Path, pathlib.Path],
) -> str:
    """``text`` (Markdown read from ``file_dir``) with links made relative to ``doc_dir``."""

    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        if urllib.parse.urlsplit(target).scheme or target.startswith("#"):
            return match[0]
        path, hash_, anchor = target.partition("#")
        resolved = pathlib.Path(os.path.normpath(file_dir / path))
        if resolved in pages:
            resolved = pages[resolved]
        elif resolved.is_dir():
            return match["text"]
        elif not resolved.is_file():
            return match[0]
        return f"[{match['text']}]({os.path.relpath(resolved, doc_dir)}{hash_}{anchor})"

    # Code blocks keep their text: split on fences, rewrite the even (prose) parts only.
    parts = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$)", text, flags=re.M | re.S)
    return "".join(p if i % 2 else LINK.sub(replace, p) for i, p in enumerate(parts))


def _pages(app: Sphinx) -> dict[pathlib.Path, pathlib.Path]:
    root = (pathlib.Path(app.srcdir) / app.config.repolinks_root).resolve()
    return {
        (root / repo_path).resolve(): (pathlib.Path(app.srcdir) / f"{docname}.md").resolve()
        for repo_path, docname in app.config.repolinks_pages.items()
    }


def _doc_dir(app: Sphinx, docname: str) -> pathlib.Path:
    return (pathlib.Path(app.srcdir) / docname).resolve().parent


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    if not str(app.env.doc2path(docname)).endswith(".md"):
        return
    here = _doc_dir(app, docname)
    source[0] = rewrite(source[0], here, here, _pages(app))


def _include_read(
    app: Sphinx, relative_path: pathlib.Path, parent_docname: str, content: list[str]
) -> None:
    path = (pathlib.Path(app.srcdir) / relative_path).resolve()
    if path.suffix != ".md":
        return
    doc_dir = _doc_dir(app, app.env.docname)
    content[0] = rewrite(content[0], path.parent, doc_dir, _pages(app))


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("repolinks_root", "..", "env")
    app.add_config_value("repolinks_pages", {}, "env")
    app.connect("source-read", _source_read)
    app.connect("include-read", _include_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
