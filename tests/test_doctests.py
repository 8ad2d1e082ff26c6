"""Every ``>>>`` example in the package's docstrings runs (the examples the API reference shows).

The examples are collected with :mod:`doctest` from every module of the package (so a module
added later is covered), one test per docstring, and run with the module's globals, as
``python -m doctest`` and ``pytest --doctest-modules`` would. Here they run inside the test
suite's process, with its 8 CPU devices.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import pkgutil

import pytest

import lossscale_jax

# Slow (make test-fast leaves it out): every docstring example (make doctest runs them alone).
pytestmark = pytest.mark.slow

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


# The modules of an optional integration import its framework: left out where it is not
# installed (make test-tunix's and make test-easydel's venvs have them). Module prefix -> the
# framework's package; integrations/_host imports no framework.
OPTIONAL = {
    "lossscale_jax.integrations.tunix": "tunix",
    "lossscale_jax.integrations.easydel": "easydel",
}


def _importable(name: str) -> bool:
    needs = [pkg for prefix, pkg in OPTIONAL.items() if name.startswith(prefix)]
    return all(importlib.util.find_spec(pkg) is not None for pkg in needs)


def _walk_error(name: str) -> None:
    """An optional integration's package, walked into where its framework is not installed:
    skipped; any other package that fails to import: the error, raised."""
    if _importable(name):
        raise  # pkgutil calls this inside its except block: the error re-raised


def _modules() -> list:
    names = [lossscale_jax.__name__]
    prefix = lossscale_jax.__name__ + "."
    names += [
        info.name
        for info in pkgutil.walk_packages(lossscale_jax.__path__, prefix, onerror=_walk_error)
    ]
    return [importlib.import_module(name) for name in sorted(names) if _importable(name)]


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {t.name: t for m in _modules() for t in finder.find(m, m.__name__) if t.examples}
    return [found[name] for name in sorted(found)]


EXAMPLES = _examples()


def _public_objects():
    """Every public function and class: ``__all__`` of the package and of its modules."""
    for module in _modules():
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if callable(obj):
                yield obj
                yield from (v for v in vars(obj).values() if callable(v) or hasattr(v, "__func__"))


def test_every_public_example_is_collected():
    # Guards the collection itself: a finder that silently found nothing (or skipped a
    # module) would make the parametrized cases below vanish.
    collected = {t.name for t in EXAMPLES}
    expected = set()
    for obj in _public_objects():
        obj = getattr(obj, "__func__", obj)
        qualname = getattr(obj, "__qualname__", None)
        if qualname and ">>>" in (obj.__doc__ or ""):
            expected.add(f"{obj.__module__}.{qualname}")
    assert len(expected) >= 20
    assert expected <= collected, sorted(expected - collected)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example(example: doctest.DocTest):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    result = runner.run(example, out=report.write, clear_globs=True)
    assert result.attempted == len(example.examples)
    assert result.failed == 0, report.getvalue()
