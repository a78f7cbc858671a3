# The two set-up commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both create .venv on first use and install the project into it; later runs reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch: a bare `torch` requirement may pull a multi-GB CUDA build instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint format install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/decode.py

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
