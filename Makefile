# Everything runs from a virtual environment this Makefile creates on demand,
# so both commands work on a machine with no jax installed. The packages come from PyPI
# through uv (installed into the venv by pip; it resolves as pip does, the same versions, and
# installs a fresh environment in ~15 s where pip took ~90 s); the venv keeps pip.
# The interpreter: PYTHON where it is given (make test PYTHON=python3.11), else the newest of
# PYTHONS that the machine has (JAX 0.11 and newer need Python 3.12 or later). A name is looked
# up on PATH, then among pyenv's installed versions (no `pyenv shell` needed). Each interpreter
# gets a virtual environment of its own, so that several coexist: .venv for the default,
# .venv-python3.11 for PYTHON=python3.11.
PYTHONS := python3.13 python3.12 python3.11
PYTHON ?=
VENV ?= $(if $(PYTHON),.venv-$(notdir $(PYTHON)),.venv)
# A pip constraints file for the install (make test-floor's), and the extras installed.
CONSTRAINTS ?=
EXTRAS ?= test,examples,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Test processes (pytest-xdist): one process keeps about 1.4 of 2 cores busy on average (the
# suite is mostly single-threaded compilation); two keep both busy. --dist loadscope: a test
# module runs on one worker, so what its tests share (a module fixture such as an example's run
# or the docs build, steps compiled once and cached) is made once, not once per worker.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: demo test test-select test-fast test-floor test-tunix test-tunix-main test-easydel test-gpu lint \
	typecheck clean docs docs-outputs doctest dist

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@for name in $(or $(PYTHON),$(PYTHONS)); do \
		exe=$$($$name -c 'import sys; print(sys.executable)' 2>/dev/null || ls -d \
			"$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/*/bin/$$name 2>/dev/null | sort -V | tail -n 1); \
		[ -n "$$exe" ] && break; \
	done; \
	[ -n "$$exe" ] || { echo "make: no $(or $(PYTHON),$(PYTHONS)) on PATH or among pyenv's" \
		"versions: install one, or name another: make $(MAKECMDGOALS) PYTHON=python3.X" >&2; \
		exit 1; }; \
	echo "$$exe -m venv $(VENV)" && $$exe -m venv $(VENV)
	$(BIN)/python -m pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e ".[$(EXTRAS)]" \
		$(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	@$(BIN)/python -c "import sys, importlib.metadata as m; print(f'Python {sys.version.split()[0]}', \
		*(f'{p} {m.version(p)}' for p in ('jax', 'jaxlib', 'optax', 'flax', 'chex')), sep=', ')"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_gpt.py

# The whole suite (CI runs this, with LOSSSCALE_JAX_SKIP=select): about 13 minutes on 2 cores
# on Python 3.13 and JAX 0.12.
test: $(STAMP)
	$(PYTEST)

# The whole suite with the skip formulated as a GPU takes it (a select per leaf; the CPU's own
# is a lax.cond): what CI runs, the GPU's code path on a CPU.
test-select: $(STAMP)
	LOSSSCALE_JAX_SKIP=select $(PYTEST)

# The change-test loop: the tests not marked slow (pyproject.toml lists what slow covers),
# under 90 seconds on 2 cores. make test before pushing.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# The oldest versions pyproject.toml admits (CI runs it beside make test, which gets the newest):
# the tests not marked slow on the oldest Python, with each dependency at its lowest version
# (.ci/floor-constraints.txt), in a venv of its own. Test tools and the docs build are not
# pinned: they are not what a user installs with the package.
FLOOR_PYTHON ?= python3.11
test-floor:
	$(MAKE) test-fast PYTHON=$(FLOOR_PYTHON) VENV=.venv-floor \
		CONSTRAINTS=.ci/floor-constraints.txt EXTRAS=test,examples

# The Tunix integration (lossscale_jax[tunix]: google-tunix pulls about 90 packages, 1.2 GB) in
# a venv of its own, on the newest Python: its tests, the example's included
# (tests/test_integration_tunix*.py), MaxText's post-training on Tunix included
# (tests/test_integration_tunix_maxtext.py: maxtext 0.2.5 added to that venv, below; about 100 s
# of the run on 2 cores, two workers importing MaxText). make test skips them where Tunix or
# MaxText is not installed, saying so. CI runs it in the newest leg.
TUNIX_VENV ?= .venv-tunix
test-tunix:
	$(MAKE) $(TUNIX_VENV)/.installed-stamp VENV=$(TUNIX_VENV) EXTRAS=test,tunix
	$(MAKE) $(TUNIX_VENV)/.maxtext-stamp
	$(TUNIX_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist load \
		tests/test_integration_tunix*.py "tests/test_docs.py::test_code_blocks_run[rl.md]"

# Tunix's main branch (its next release's seams: a gradient accumulator of its own, losses as a
# LossOutput; tests/test_integration_tunix_main.py, which make test-tunix runs and skips, saying
# so, until pip resolves a release with them), from its source at the commit tested, in a venv
# of its own on Python 3.12 with the JAX it admits (.ci/tunix-main-requirements.txt). Tunix goes
# in with --no-deps. TUNIX_SOURCE: a checkout of google/tunix, or pip's git URL (needs network).
TUNIX_MAIN_VENV ?= .venv-tunix-main
TUNIX_MAIN_COMMIT ?= c7d8950
TUNIX_SOURCE ?= git+https://github.com/google/tunix@$(TUNIX_MAIN_COMMIT)
test-tunix-main: $(TUNIX_MAIN_VENV)/.tunix-main-stamp
	$(TUNIX_MAIN_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist load \
		tests/test_integration_tunix_main.py

$(TUNIX_MAIN_VENV)/.tunix-main-stamp: .ci/tunix-main-requirements.txt
	$(MAKE) $(TUNIX_MAIN_VENV)/.installed-stamp VENV=$(TUNIX_MAIN_VENV) PYTHON=python3.12 \
		EXTRAS=test CONSTRAINTS=.ci/tunix-main-requirements.txt
	$(TUNIX_MAIN_VENV)/bin/uv pip install -q --python $(TUNIX_MAIN_VENV)/bin/python \
		-r .ci/tunix-main-requirements.txt
	$(TUNIX_MAIN_VENV)/bin/uv pip install -q --python $(TUNIX_MAIN_VENV)/bin/python --no-deps \
		"$(TUNIX_SOURCE)"
	touch $@

# MaxText's post-training (tests/test_integration_tunix_maxtext.py) in the Tunix venv: the
# packages of pyproject.toml's maxtext extra, without their dependencies (the extra says why).
$(TUNIX_VENV)/.maxtext-stamp: $(TUNIX_VENV)/.installed-stamp
	$(TUNIX_VENV)/bin/uv pip install -q --python $(TUNIX_VENV)/bin/python --no-deps \
		$$($(TUNIX_VENV)/bin/python -c "import tomllib; print(' '.join(tomllib.load(open( \
		'pyproject.toml', 'rb'))['project']['optional-dependencies']['maxtext']))")
	touch $@

# The EasyDeL integration (lossscale_jax[easydel]) in a venv of its own, on Python 3.12 and this
# package's floor (.ci/easydel-constraints.txt): pip cannot resolve easydel 0.3.0's own pins
# against this package's (pyproject.toml's easydel extra says why), so easydel, eformer and
# ejkernel go in with --no-deps and the rest of the extra (what EasyDeL's trainers import on a
# CPU) with theirs. EASYDEL_AUTO=0: EasyDeL's import otherwise adds GPU flags to XLA_FLAGS that
# jaxlib 0.10.2 on a CPU refuses. Its tests (tests/test_integration_easydel.py, the example's
# included) and docs/easydel.md's code on the suite's 8 CPU devices, then GRPO's on one (stock
# EasyDeL's GRPO, DPO and PPO fail on a multi-device CPU mesh); make test skips them without EasyDeL.
EASYDEL_VENV ?= .venv-easydel
EASYDEL_PYTHON ?= python3.12
EASYDEL_NO_DEPS := easydel eformer ejkernel
test-easydel:
	$(MAKE) $(EASYDEL_VENV)/.installed-stamp VENV=$(EASYDEL_VENV) PYTHON=$(EASYDEL_PYTHON) \
		EXTRAS=test CONSTRAINTS=.ci/easydel-constraints.txt
	$(MAKE) $(EASYDEL_VENV)/.easydel-stamp
	EASYDEL_AUTO=0 $(EASYDEL_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist load \
		tests/test_integration_easydel.py "tests/test_docs.py::test_code_blocks_run[easydel.md]"
	EASYDEL_AUTO=0 LSJ_TEST_CPU_DEVICES=1 $(EASYDEL_VENV)/bin/python -m pytest -q \
		tests/test_integration_easydel.py -k "grpo or dpo or ppo"

$(EASYDEL_VENV)/.easydel-stamp: $(EASYDEL_VENV)/.installed-stamp pyproject.toml
	$(EASYDEL_VENV)/bin/python -c "import tomllib; e = tomllib.load(open('pyproject.toml', 'rb'))[ \
		'project']['optional-dependencies']['easydel']; n = '$(EASYDEL_NO_DEPS)'.split(); \
		open('$(EASYDEL_VENV)/no-deps.txt', 'w').write('\n'.join(r for r in e if r.split('=')[0] in n)); \
		open('$(EASYDEL_VENV)/deps.txt', 'w').write('\n'.join(r for r in e if r.split('=')[0] not in n))"
	$(EASYDEL_VENV)/bin/uv pip install -q --python $(EASYDEL_VENV)/bin/python --no-deps \
		-r $(EASYDEL_VENV)/no-deps.txt
	$(EASYDEL_VENV)/bin/uv pip install -q --python $(EASYDEL_VENV)/bin/python \
		-c .ci/easydel-constraints.txt -r $(EASYDEL_VENV)/deps.txt
	touch $@

# The whole suite on JAX's default accelerator, in the environment's own Python (no .venv:
# the machine's JAX has CUDA; pip install -e . --no-deps, jmp==0.0.4 and the test extras
# first). The CPU platform stays beside the GPU; tests that need 8 devices skip with the
# reason on a one-GPU machine, those that read XLA:CPU's HLO say so. -p no:benchmark: an
# installed pytest-benchmark warns under xdist, and warnings are errors here. Never in CI.
# GPU_TEST_WORKERS: 12 of a 16-core machine's cores compile (a worker is one process on the GPU;
# the suite is mostly compilation); the 25 slowest tests are listed for the next tuning.
# --dist loadgroup: a module on one worker, as loadscope, but for tests/conftest.py's SPREAD
# modules (the property test, the docs' code blocks: the two longest of a CPU run, 190 s and
# 108 s), whose tests go to any worker. On an H200 with loadscope, ~30 tests were still to
# run at 291 s.
GPU_TEST_WORKERS ?= 12
test-gpu:
	JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false $(or $(PYTHON),python3) -m pytest -q \
		-p no:benchmark -n $(GPU_TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		--durations=25

lint: $(STAMP)
	$(BIN)/ruff check lossscale_jax tests examples benchmarks experiments docs/conf.py docs/_ext docs/_inventories
	$(BIN)/ruff format --check lossscale_jax tests examples benchmarks experiments docs/conf.py docs/_ext docs/_inventories

# The type check (pyright; settings in pyproject.toml): no error in the package, and the type of
# every public name known (--verifytypes fails below 100%; it reads the interpreter on PATH and
# the package from PYTHONPATH, not --pythonpath). Node.js is the pinned wheel's, whatever node the
# machine has; no network: the version check is off.
PYRIGHT := PYRIGHT_PYTHON_IGNORE_WARNINGS=1 PYRIGHT_PYTHON_GLOBAL_NODE=0 $(BIN)/pyright
typecheck: $(STAMP)
	$(PYRIGHT) --pythonpath $(BIN)/python
	PATH="$(abspath $(BIN)):$$PATH" PYTHONPATH="$(CURDIR)" $(PYRIGHT) --verifytypes lossscale_jax --ignoreexternal

# The documentation site, into docs/_build/html; any warning fails (as in the test suite).
docs: $(STAMP)
	$(BIN)/python -m sphinx -b html -n -W --keep-going docs docs/_build/html

# What the example scripts print and draw, as the docs show it (docs/examples/*.md and the
# GPT job's table and plot on docs/validating.md): every example run with its defaults, the
# outputs written to docs/_static/examples. About ten minutes on two CPU cores, most of it
# the GPT job and the RL job. Commit the files it changes with the change that changed them.
EXAMPLE_OUT := docs/_static/examples
docs-outputs: $(STAMP)
	mkdir -p $(EXAMPLE_OUT)
	for name in linear_regression_underflow npu_saturation data_parallel train_equinox; do \
		$(BIN)/python examples/$$name.py > $(EXAMPLE_OUT)/$$name.txt || exit 1; done
	$(BIN)/python examples/train_digits.py --no-progress --out $(EXAMPLE_OUT) > /dev/null
	$(BIN)/python examples/train_gpt.py --no-progress --out $(EXAMPLE_OUT) > /dev/null
	$(BIN)/python examples/train_layerwise.py --no-progress --out $(EXAMPLE_OUT) > /dev/null
	$(BIN)/python examples/train_rl.py --no-progress --out $(EXAMPLE_OUT) > /dev/null

# The docstring examples alone (the test suite runs them too).
doctest: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_doctests.py

# The sdist and the wheel, into dist/, checked by twine.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

clean:
	rm -rf .venv .venv-* .pytest_cache .hypothesis docs/_build dist
