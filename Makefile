# One-command set-up: `make serve` and `make test` create .venv, install the project, then run.
# Without a GPU the CPU build of torch is installed (pip resolves torch==2.13.0 locally); with CUDA
# present (nvidia-smi works) pip's default CUDA build is used.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)
MODEL ?= tiny-dsa
SERVE_ARGS ?=
UP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve serve-pd test test-gpu lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/decode-server serve --model-path $(MODEL) $(SERVE_ARGS)

# A local prefill/decode deployment: prefill + decode (HiSparse) servers and the PD router on :30000.
serve-pd: $(STAMP)
	$(VENV)/bin/decode-server up --model-path $(MODEL) $(UP_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not gpu and not slow" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
