# Everything runs from a virtual environment this Makefile creates on demand,
# so both commands work on a machine with no jax installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,examples]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_gpt.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check lossscale_jax tests examples benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
