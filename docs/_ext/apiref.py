"""The API reference, generated from each module's ``__all__``.

``.. api:: MODULE`` documents every name of ``MODULE.__all__``, so a name added to
``__all__`` appears without editing the docs, and the build warns (an error under ``-W``)
when a public name, or a public method of a public class, has no docstring::

    .. api:: lossscale_jax

       transform: The transformation
       policies: Policies and state

The optional lines order the sections and give them titles: the names are grouped by the
public module or package they belong to, never by the private file that defines them
(``lossscale_jax.policies._fixed`` and ``lossscale_jax.engine._state`` are both
``lossscale_jax.policies``; see ``_home``); a public module not listed gets a section titled
with the first line of its docstring, after the listed ones. A line without a module
(``: Title``) titles the names that belong to ``MODULE`` itself. A module named
in ``__all__`` (``compat``, ``testing``) is linked, not inlined, and must be documented by
an ``api`` directive of its own somewhere in the site (the build warns otherwise).

With ``:namespaces:``, every name of ``__all__`` is a namespace (a module, or a class used
as one) documented in a section of its own: its docstring, then its public functions.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import textwrap
import types
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


def _defined_in(obj: Any, package: str) -> bool:
    """Whether ``obj`` (a function, method or property) is code of ``package``."""
    if isinstance(obj, staticmethod | classmethod):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    module = getattr(obj, "__module__", None) or ""
    return module == package or module.startswith(package + ".")


def _public_methods(cls: type, package: str) -> list[str]:
    """Public methods and properties of ``cls`` written in ``package``, in source order.

    Methods that a base class from another library adds (chex's ``replace``, Flax's
    ``apply_gradients`` of its own ``TrainState``) are that library's to document.
    """
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if name.startswith("_") or name in names:
                continue
            if isinstance(value, types.FunctionType | staticmethod | classmethod | property):
                if _defined_in(value, package):
                    names.append(name)
    return names


def _namespace_functions(ns: Any, package: str) -> list[str]:
    """The public functions of a namespace: a module's ``__all__``, a class's functions."""
    if isinstance(ns, types.ModuleType):
        if hasattr(ns, "__all__"):
            return list(ns.__all__)
        return [
            n
            for n, v in vars(ns).items()
            if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == ns.__name__
        ]
    return [
        n
        for n, v in vars(ns).items()
        if not n.startswith("_")
        and isinstance(v, types.FunctionType | staticmethod | classmethod)
        and _defined_in(v, package)
    ]


def _public(module: str) -> str:
    """The public module or package a module belongs to: its path up to its first private part."""
    parts = module.split(".")
    private = [i for i, part in enumerate(parts) if part.startswith("_")]
    return ".".join(parts[: private[0]]) if private else module


def _home(obj: Any, name: str, modname: str, listed: list[str]) -> str:
    """Where a public name of ``modname`` is documented: the public package that defines and
    exports it (``policies`` for ``policies._fixed.StaticScale``); else the first listed
    section whose module exports it in ``__all__``, then the first that has it at all
    (``lsj.TapStats``, importable from ``lossscale_jax.taps``); else ``modname`` itself."""
    defined = _public(getattr(obj, "__module__", None) or modname)
    if defined != modname and name in getattr(importlib.import_module(defined), "__all__", ()):
        return defined
    modules = {m: importlib.import_module(m) for m in listed if m != modname}
    for m, module in modules.items():
        if name in getattr(module, "__all__", ()):
            return m
    for m, module in modules.items():
        if getattr(module, name, None) is obj:
            return m
    return modname


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0].rstrip(".") if doc.strip() else ""


def _title(text: str) -> list[str]:
    return [text, "-" * len(text), ""]


def _indent(text: str, prefix: str = "   ") -> list[str]:
    return [prefix + line if line.strip() else "" for line in text.splitlines()]


class ApiDirective(SphinxDirective):
    """``.. api:: MODULE``: the reference of every name in ``MODULE.__all__``."""

    required_arguments = 1
    has_content = True
    option_spec = {"namespaces": directives.flag}

    def _warn(self, message: str) -> None:
        logger.warning(message, location=self.get_location(), type="apiref")

    def _check_doc(self, path: str, obj: Any) -> None:
        if not (inspect.getdoc(obj) or "").strip():
            self._warn(f"{path} is public but has no docstring")

    def _sections(self) -> dict[str, str]:
        titles: dict[str, str] = {}
        for line in self.content:
            if line.strip():
                module, _, title = line.partition(":")
                titles[module.strip()] = title.strip()
        return titles

    def _document(self, path: str, obj: Any, modname: str, name: str) -> list[str]:
        """The autodoc directive for one public object, after checking its docstrings."""
        if inspect.isclass(obj):
            self._check_doc(path, obj)
            members = _public_methods(obj, modname.split(".")[0])
            for member in members:
                self._check_doc(f"{path}.{member}", getattr(obj, member))
            lines = [f".. autoclass:: {path}"]
            if members:
                lines.append(f"   :members: {', '.join(members)}")
            return [*lines, ""]
        if callable(obj):
            self._check_doc(path, obj)
            return [f".. autofunction:: {path}", ""]
        # Data (e.g. __version__): documented by a "#:" comment above its assignment.
        attr_docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        if ("", name) not in attr_docs:
            self._warn(f"{path} is public but has no '#:' doc comment")
        return [f".. autodata:: {path}", ""]

    def run(self) -> list[nodes.Node]:
        modname = self.arguments[0]
        if pathlib.Path(self.env.doc2path(self.env.docname)).suffix != ".rst":
            # The generated text is reStructuredText; a Markdown page would parse it as
            # Markdown and show the directives as text, without a warning.
            self._warn("the api directive must be used in a reStructuredText (.rst) page")
            return []
        module = importlib.import_module(modname)
        # Rebuild the page when the module or this generator changes.
        for path in (module.__file__, __file__):
            if path:
                self.env.note_dependency(path)
        names = getattr(module, "__all__", None)
        if names is None:
            self._warn(f"{modname} has no __all__")
            return []
        self._check_doc(modname, module)
        documented = self.env.domaindata.setdefault("apiref", {"modules": {}, "links": {}})
        documented["modules"][modname] = self.env.docname

        lines = [f".. automodule:: {modname}", "   :no-members:", ""]
        lines += [f".. currentmodule:: {modname}", ""]
        if "namespaces" in self.options:
            lines += self._namespaces(module, modname, names)
        else:
            lines += self._grouped(module, modname, names)
        return self.parse_text_to_nodes("\n".join(lines), allow_section_headings=True)

    def _grouped(self, module: types.ModuleType, modname: str, names: list[str]) -> list[str]:
        submodules = [n for n in names if isinstance(getattr(module, n), types.ModuleType)]
        objects = [n for n in names if n not in submodules]
        titles = {
            f"{modname}.{short}" if short else modname: title
            for short, title in self._sections().items()
        }
        groups: dict[str, list[str]] = {}
        for name in objects:
            home = _home(getattr(module, name), name, modname, list(titles))
            groups.setdefault(home, []).append(name)
        for listed in titles:
            if listed not in groups:
                self._warn(f"section {listed!r} holds no name of {modname}.__all__")
        order = [m for m in titles if m in groups] + sorted(set(groups) - set(titles))

        lines = ["Summary", "-------", "", ".. autosummary::", "   :nosignatures:", ""]
        lines += [f"   {name}" for m in order for name in groups[m]]
        lines.append("")
        if submodules:
            lines += ["Modules: " + ", ".join(f":mod:`{modname}.{n}`" for n in submodules), ""]
            documented = self.env.domaindata["apiref"]["links"]
            for n in submodules:
                documented[f"{modname}.{n}"] = self.env.docname
        for group in order:
            # Names defined in the module itself sit under its docstring, shown above.
            if group != modname or group in titles:
                lines += _title(titles.get(group) or _first_line(importlib.import_module(group)))
            for name in groups[group]:
                obj = getattr(module, name)
                # autodata reads a '#:' comment in the module that assigns the name.
                defined = getattr(obj, "__module__", None) or modname
                lines += self._document(f"{modname}.{name}", obj, defined, name)
        return lines

    def _namespaces(self, module: types.ModuleType, modname: str, names: list[str]) -> list[str]:
        config = self.env.app.config
        lines: list[str] = []
        for name in names:
            ns = getattr(module, name)
            path = f"{modname}.{name}"
            self._check_doc(path, ns)
            lines += _title(f"{name}")
            # The namespace as a module target (it is one, or becomes one), its docstring as
            # text, then each constructor as a function of that module.
            doc = str(GoogleDocstring(inspect.getdoc(ns) or "", config, what="module"))
            lines += [f".. py:module:: {path}", "", *doc.splitlines(), ""]
            lines += [f".. currentmodule:: {path}", ""]
            functions = _namespace_functions(ns, modname.split(".")[0])
            for fname in functions:
                fn = getattr(ns, fname)
                self._check_doc(f"{path}.{fname}", fn)
                lines += [f".. autofunction:: {path}.{fname}", ""]
            if not functions:
                self._warn(f"namespace {path} has no public function")
            lines += [f".. currentmodule:: {modname}", ""]
        return lines


def _class_signature(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str | None, ret: Any
) -> tuple[str, Any] | None:
    """A class whose metaclass defines ``__call__(*args, **kwargs)`` (Flax NNX modules and
    optimizers) shows the signature of its ``__init__`` instead."""
    if what != "class" or signature != "(*args, **kwargs)" or "__init__" not in vars(obj):
        return None
    init = inspect.signature(obj.__init__)
    defaults = _source_defaults(obj.__init__)
    params = [
        p.replace(
            annotation=inspect.Parameter.empty,
            default=defaults.get(p.name, p.default),
        )
        for p in list(init.parameters.values())[1:]
    ]
    return str(init.replace(parameters=params, return_annotation=inspect.Signature.empty)), None


class _Source:
    """A default value shown as its source text (``nnx.BatchStat``, not its repr)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _source_defaults(fn: Any) -> dict[str, _Source]:
    """The default values of ``fn``'s arguments as written in its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return {}
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return {}
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    with_default = positional[len(positional) - len(args.defaults) :]
    pairs = list(zip(with_default, args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d]
    return {a.arg: _Source(ast.unparse(d)) for a, d in pairs}


def _check_linked_modules(app: Sphinx, env: Any) -> None:
    """Every module named in an ``__all__`` has a page of its own."""
    data = env.domaindata.get("apiref", {"modules": {}, "links": {}})
    for target, docname in sorted(data["links"].items()):
        if target not in data["modules"]:
            logger.warning(
                f"{target} is public but no 'api' directive documents it",
                location=docname,
                type="apiref",
            )


def _purge(app: Sphinx, env: Any, docname: str) -> None:
    data = env.domaindata.get("apiref")
    if data:
        for table in data.values():
            for key in [k for k, d in table.items() if d == docname]:
                del table[key]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("api", ApiDirective)
    app.connect("env-purge-doc", _purge)
    app.connect("autodoc-process-signature", _class_signature)
    app.connect("env-check-consistency", _check_linked_modules)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
