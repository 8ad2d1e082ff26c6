"""Loading the repository's scripts and the benchmark's package as modules, for their tests."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.cache
def load_script(relative_path: str) -> ModuleType:
    """The script at ``ROOT / relative_path``, imported once per test process.

    It is registered in ``sys.modules`` under ``script_<stem>`` before it runs: Flax modules
    are dataclasses, which look their own module up while the class is being made.
    """
    path = ROOT / relative_path
    name = f"script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def import_benchmark(module: str) -> ModuleType:
    """``bench.<module>``, a module of the benchmark's package (benchmarks/bench/).

    ``benchmarks/`` goes on ``sys.path`` as ``python benchmarks/bench_step.py`` puts it there.
    """
    path = str(ROOT / "benchmarks")
    if path not in sys.path:
        sys.path.append(path)
    return importlib.import_module(f"bench.{module}")
