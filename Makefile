# One-command set-up: `make serve` and `make test` create .venv, install the project, then run.
# Without a GPU the CPU build of torch is installed (pip resolves torch==2.13.0 locally); with CUDA
# present (nvidia-smi works) pip's default CUDA build is used.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)
# Triton for the CPU checks of the Triton kernels (interpreter + sm_90 compile, tests/kernels/test_triton_cpu.py):
# on GPU machines torch brings its own; elsewhere the GPU image's version (the tests skip if it fails to install).
TRITON_SPEC := $(if $(HAS_GPU),,triton==3.6.0)
MODEL ?= tiny-dsa
SERVE_ARGS ?=
UP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve serve-pd test test-image test-gpu lint bench clean system-libs

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(if $(TRITON_SPEC),$(PY) -m pip install -q "$(TRITON_SPEC)" || echo "WARNING: $(TRITON_SPEC) not installed; \
		tests/kernels/test_triton_cpu.py will be skipped" >&2)
	$(PY) -m pip install -q -e ".[test,bench,structured]"
	$(PY) -m pip install -q -e ".[$$($(PY) -c "$$PD_EXTRA_PY")]"
	@$(MAKE) --no-print-directory system-libs
	touch $(STAMP)

# The PD extra matching torch's CUDA runtime: pd (CPU), pd-cuda12, pd-cuda13 (see pyproject.toml).
export PD_EXTRA_PY := import torch; v = torch.version.cuda; print("pd-cuda" + v.split(".")[0] if v else "pd")

# System libraries that mooncake's transfer engine links even for TCP (soname:Debian package). Install the missing
# ones quietly where we can (root with apt-get); elsewhere say what is missing (PD transfers fail without them).
# `python -m decode_server.ops check-libs` lists every library the installed wheels link and cannot find.
SYSTEM_LIBS := libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4

system-libs:
	@missing=""; for pair in $(SYSTEM_LIBS); do \
		ldconfig -p 2>/dev/null | grep -q "$${pair%%:*} " || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (needed by the mooncake transfer engine, even for TCP)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq $$missing >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $$missing >/dev/null; } || \
		echo "WARNING: apt-get could not install$$missing; PD transfers (tests/transfer) will fail" >&2; \
	else \
		echo "WARNING: missing system packages:$$missing (Debian/Ubuntu names) and they cannot be installed" >&2; \
		echo "  here (needs root and apt-get). Install them (RHEL/Fedora: rdma-core, numactl-libs, libcurl);" >&2; \
		echo "  tests/transfer and --disaggregation-mode prefill|decode fail without them." >&2; \
	fi

serve: $(STAMP)
	$(VENV)/bin/decode-server serve --model-path $(MODEL) $(SERVE_ARGS)

# A local prefill/decode deployment: prefill + decode (HiSparse) servers and the PD router on :30000.
serve-pd: $(STAMP)
	$(VENV)/bin/decode-server up --model-path $(MODEL) $(UP_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not gpu and not slow and not image" $(PYTEST_ARGS)

# Builds the CPU image and runs the compose deployment in a Docker engine of its own (docs/deploy.md): run it
# before submitting a change to the Dockerfile, deploy/ or the dependencies; CI runs it after `make test`.
test-image: $(STAMP)
	$(PY) -m pytest -q -m image tests/deploy/test_container.py $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
