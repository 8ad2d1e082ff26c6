"""Inline code that names an object links to that object's documentation.

The guides write names as code, the way a user types them: ``lsj.metrics(opt_state)``,
``compat.torch.GradScaler``, ``optax.chain``, ``lax.cond``. After a page is read, each inline
literal that starts with a known prefix becomes a cross-reference to the longest dotted name
that exists, with the literal's text unchanged:

- ``lsj.`` and ``lossscale_jax.`` -> ``lossscale_jax.X``, ``compat.`` ->
  ``lossscale_jax.compat.X``: the API reference's entry, which ``docs/_ext/apiref.py``
  documents under the public name (``lossscale_jax.X``), whichever module defines it, so a
  link survives the package's internal moves. A name the reference does not document is a
  warning (an error under ``-W``): a guide must not name what the package does not export.
- ``jax.``, ``lax.``, ``jnp.``, ``optax.``, ``flax.``, ``nnx.``, ``chex.`` -> that library's
  documentation, through ``sphinx.ext.intersphinx`` (the names its inventory lists; others
  stay plain text).

Code blocks, titles and literals that already sit in a link are left alone.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx

# Prefix as written -> the module it stands for.
ALIASES = {
    "lsj": "lossscale_jax",
    "lossscale_jax": "lossscale_jax",
    "compat": "lossscale_jax.compat",
    "jax": "jax",
    "lax": "jax.lax",
    "jnp": "jax.numpy",
    "optax": "optax",
    "flax": "flax",
    "nnx": "flax.nnx",
    "chex": "chex",
}
NAME = re.compile(r"(?P<prefix>[A-Za-z_]\w*)(?P<rest>(?:\.[A-Za-z_]\w*)+)")


def _documentable(obj: Any) -> bool:
    """What an API reference has an entry for: modules, classes, functions, properties."""
    kinds = types.ModuleType | property | classmethod | staticmethod
    return isinstance(obj, kinds) or inspect.isclass(obj) or callable(obj)


def target(text: str) -> str | None:
    """The full name that ``text`` (inline code) names, or None if it names nothing known.

    >>> target('lsj.metrics(opt_state)["stuck"]')
    'lossscale_jax.metrics'
    >>> target("lax.cond")
    'jax.lax.cond'
    """
    match = NAME.match(text)
    if not match or match["prefix"] not in ALIASES:
        return None
    try:
        obj: Any = importlib.import_module(ALIASES[match["prefix"]])
    except ImportError:
        return None
    found = ALIASES[match["prefix"]]
    for part in match["rest"].split(".")[1:]:
        child = inspect.getattr_static(obj, part, None) if inspect.isclass(obj) else None
        if child is None:
            child = getattr(obj, part, None)
        if child is None or not _documentable(child):
            break
        obj, found = child, f"{found}.{part}"
    return None if found == ALIASES[match["prefix"]] else found


def _link_names(app: Sphinx, doctree: nodes.document) -> None:
    for literal in list(doctree.findall(nodes.literal)):
        parent = literal.parent
        if isinstance(parent, nodes.reference | addnodes.pending_xref | nodes.title):
            continue
        if isinstance(parent, nodes.literal_block) or "xref" in literal["classes"]:
            continue
        full = target(literal.astext())
        if full is None:
            continue
        xref = addnodes.pending_xref(
            "",
            refdomain="py",
            reftype="obj",
            reftarget=full,
            refexplicit=True,
            refwarn=full.startswith("lossscale_jax"),
            refdoc=app.env.docname,
        )
        literal["classes"] += ["xref", "py", "py-obj"]
        parent.replace(literal, xref)
        xref += literal


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("doctree-read", _link_names)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
