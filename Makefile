# The quick start is `make demo` and `make test`; each bootstraps .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on these machines' disk; a looser spec pulls a
# multi-GB CUDA build. The library itself only asks for torch>=2.4 (pyproject.toml).
TORCH_PIN ?= torch==2.13.0
# Peers installed without their dependencies: both pull torchvision, whose PyPI
# build cannot load beside the CPU torch; the tests load only their loss modules.
# open-clip-torch also ships open_clip_train (its training CLI): the package imports,
# but its `main` and `train` modules import open_clip (so torchvision); the tests run
# open_clip_train/train.py from its installed file (tests/support/peers.py).
NODEPS_PEERS ?= open-clip-torch==3.3.0 lightly==1.6.0
# -qq: pip's errors only; the lines below say what the bootstrap is doing.
PIP := $(PY) -m pip install -qq --disable-pip-version-check

.PHONY: demo test test-heavy test-all test-fast test-compat bench lint gpu clean venv-oct

$(VENV)/.installed: pyproject.toml Makefile
	@echo "==> .venv: creating it with $(PYTHON)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@echo "==> .venv: $(TORCH_PIN) (CPU build) and wholebatch with its demo and dev extras"
	@$(PIP) "$(TORCH_PIN)"
	@$(PIP) -e ".[dev,demo]" "$(TORCH_PIN)"
	@touch $@
	@echo "==> .venv: ready"

# The test suite also compares against the peer libraries (the `peers` extra).
$(VENV)/.peers: $(VENV)/.installed
	@echo "==> .venv: peer libraries for the tests (transformers, accelerate, sentence-transformers, lightning, trl, deepspeed, open_clip, lightly)"
	@$(PIP) -e ".[dev,demo,peers]" "$(TORCH_PIN)"
	@$(PIP) --no-deps $(NODEPS_PEERS)
	@touch $@

# open_clip_train's real CLI needs torchvision, which cannot load beside the CPU torch of
# .venv: it runs in its own venv (tests/e2e/test_open_clip_train_cli.py drives it through
# subprocesses), torch 2.14.1 + torchvision 0.29.1, a CUDA build that runs on CPU, ~5.6 GB.
# pip on Python 3.11 takes both from this machine's disk: measured 53 s to build on an idle
# machine, 3 min 15 s at load 18 on the 2 shared cores; 5.6 GB.
# wholebatch is not installed in it: the test puts the checkout's src/ on PYTHONPATH.
OCT_PYTHON ?= python3.11
OCT_VENV := .venv-oct
$(OCT_VENV)/.installed: tests/support/open_clip_train.txt
	@echo "==> .venv-oct: open_clip_train's CLI venv (torch 2.14.1 + torchvision 0.29.1, ~5.6 GB, about a minute)"
	@test -x $(OCT_VENV)/bin/python || $(OCT_PYTHON) -m venv $(OCT_VENV)
	@$(OCT_VENV)/bin/python -m pip install -qq --disable-pip-version-check -r tests/support/open_clip_train.txt
	@touch $@

venv-oct: $(OCT_VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/wholebatch demo

# The suite without its heavy tier (tests/conftest.py HEAVY): under 15 minutes on 2 cores.
test: $(VENV)/.peers $(OCT_VENV)/.installed
	$(PY) -m pytest -q -m "not heavy"

# The heavy tier alone (whole trainers and CLIs for more cases, fault drills, a memory
# measurement; about 8 minutes), and everything (`pytest` with no marker).
test-heavy: $(VENV)/.peers $(OCT_VENV)/.installed
	$(PY) -m pytest -q -m heavy

test-all: $(VENV)/.peers $(OCT_VENV)/.installed
	$(PY) -m pytest -q

# The unit tier alone (one process each, under a minute): the loop to run while editing.
test-fast: $(VENV)/.peers
	$(PY) -m pytest -q tests/unit

# The demo and the unit and distributed tiers on the oldest accepted torch, a middle release
# and the GPU machine's (tests/support/compat.py, docs/compatibility.md); not part of `make test`.
# One venv per torch under COMPAT_DIR, made once from the package index (CUDA builds, run on the
# CPU): 5.1-7.4 GB each, 19.4 GB for the three; about 11 minutes per torch once they exist
# (benchmarks/RESULTS.md, "Compatibility"). COMPAT_DIR=/elsewhere keeps the venvs out of the tree.
COMPAT_TORCH ?= 2.8.0 2.10.0 2.11.0
COMPAT_DIR ?= .venv-compat
COMPAT_PYTHON ?= python3.11
test-compat:
	$(COMPAT_PYTHON) -m tests.support.compat --torch $(COMPAT_TORCH) --dir $(COMPAT_DIR) --python $(COMPAT_PYTHON)

bench: $(VENV)/.peers $(OCT_VENV)/.installed
	$(VENV)/bin/wholebatch bench

# On a machine with CUDA, as it is (its python3, nothing installed, no network): the CUDA
# tests, the NCCL selftest and the GPU loss benchmark, into $(GPU_OUT) (benchmarks/gpu.sh).
GPU_OUT ?= gpu-results
gpu:
	bash benchmarks/gpu.sh $(GPU_OUT)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(OCT_VENV) $(COMPAT_DIR) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
