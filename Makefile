# The quick start is `make demo` and `make test`; each bootstraps .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on these machines' disk; a looser spec pulls a
# multi-GB CUDA build. The library itself only asks for torch>=2.4 (pyproject.toml).
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench lint clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev,demo]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/wholebatch demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/wholebatch bench

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
