"""The distributions: what ``python -m build`` makes, and the wheel installed on its own.

One build per run (sdist, then the wheel from the sdist, as a release makes them), without
build isolation so no index is needed. The wheel must hold the package, ``py.typed`` and the
licence and nothing else, pass ``twine check``, carry the version of ``lossscale_jax.__version__``,
and run the README quick start from a fresh virtual environment in which the checkout is not
importable.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest
from helpers import ROOT  # tests/ is on sys.path under pytest

import lossscale_jax

# Slow (make test-fast leaves it out): an sdist and a wheel built, a virtual environment made.
pytestmark = pytest.mark.slow

PACKAGE = ROOT / "lossscale_jax"
VERSION = lossscale_jax.__version__


def run(*cmd: str | os.PathLike, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs
    )
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT)
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def package_files() -> set[str]:
    """The package's files in the checkout: every module (subpackages too) and py.typed."""
    files = {p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    return {p.relative_to(ROOT).as_posix() for p in files | {PACKAGE / "py.typed"}}


def test_wheel_holds_the_package_and_nothing_else(dists):
    names = set(zipfile.ZipFile(dists["wheel"]).namelist())
    dist_info = f"lossscale_jax-{VERSION}.dist-info/"
    assert {n for n in names if not n.startswith(dist_info)} == package_files()
    meta = {n.removeprefix(dist_info) for n in names if n.startswith(dist_info)}
    assert meta <= {"METADATA", "WHEEL", "RECORD", "top_level.txt", "licenses/LICENSE"}
    # The licence the metadata declares travels with the wheel.
    assert "licenses/LICENSE" in meta
    metadata = zipfile.ZipFile(dists["wheel"]).read(f"{dist_info}METADATA").decode()
    assert re.search(r"^License-Expression: Apache-2.0$", metadata, re.M)


def test_sdist_holds_the_sources_without_tests(dists):
    with tarfile.open(dists["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert package_files() <= names
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "PKG-INFO"} <= names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "docs/"))]


def test_versions_agree(dists):
    assert dists["wheel"].name == f"lossscale_jax-{VERSION}-py3-none-any.whl"
    assert dists["sdist"].name == f"lossscale_jax-{VERSION}.tar.gz"
    metadata = zipfile.ZipFile(dists["wheel"]).read(f"lossscale_jax-{VERSION}.dist-info/METADATA")
    with tarfile.open(dists["sdist"]) as tar:
        pkg_info = tar.extractfile(f"lossscale_jax-{VERSION}/PKG-INFO").read()
    for text in (metadata, pkg_info):
        assert re.search(rf"^Version: {re.escape(VERSION)}$", text.decode(), re.M)
    # The version is written once, in __init__.py; CHANGELOG.md has an entry for it.
    assert f"## {VERSION}" in (ROOT / "CHANGELOG.md").read_text()


def twine_runs() -> bool:
    try:
        return importlib.util.find_spec("twine.__main__") is not None
    except ModuleNotFoundError:
        return False


def test_twine_check_passes(dists):
    # The Makefile's virtual environment (make test, and CI through .ci/run) is built from the
    # test extra, which has twine: there a missing twine fails. Elsewhere (make test-gpu runs
    # the suite in the machine's own Python, which may have none) the check skips, saying why.
    if not twine_runs():
        if pathlib.Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
            pytest.fail(f"twine is missing from {sys.prefix}, which the test extra should have")
        pytest.skip(f"twine is not installed for {sys.executable} (make test's environment has it)")
    result = run(sys.executable, "-m", "twine", "check", "--strict", *dists.values())
    assert result.stdout.count("PASSED") == 2, result.stdout


def quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"^```python\n(.*?)^```", section, re.S | re.M)[1]


def test_wheel_installs_and_runs_the_quick_start(dists, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    site = pathlib.Path(purelib.stdout.strip())
    # The third-party dependencies come from this test environment (no download); its
    # editable install of lossscale_jax does not: a directory named in a .pth file is added
    # to sys.path without processing the .pth files inside it, and the fresh environment's
    # own site-packages, holding the wheel, comes first.
    (site / "test_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # Nor does PYTHONPATH reach it: with the checkout on it (and the build's
    # lossscale_jax.egg-info there), pip would call the wheel installed and skip it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "--no-cache-dir", "--disable-pip-version-check", "-q", dists["wheel"], env=env,
    )  # fmt: skip

    script = tmp_path / "work" / "quick_start.py"
    script.parent.mkdir()
    script.write_text(
        "import lossscale_jax\n"
        "print('FILE', lossscale_jax.__file__)\n"
        "print('VERSION', lossscale_jax.__version__)\n" + quick_start()
    )
    result = run(python, "-I", script, cwd=script.parent, env=env)

    installed = pathlib.Path(re.search(r"^FILE (.*)$", result.stdout, re.M)[1]).resolve()
    assert installed.is_relative_to(site.resolve()), installed
    assert not installed.is_relative_to(ROOT)
    assert f"VERSION {VERSION}" in result.stdout
    # The quick start prints lsj.metrics(opt_state) after one good step.
    assert "'loss_scale'" in result.stdout and "'skipped'" in result.stdout, result.stdout
