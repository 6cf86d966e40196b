# Two commands for a new user: `make demo` and `make test`. Both create .venv and install into it.
# On a machine without a GPU, torch==2.13.0 is the CPU build (this machine keeps it on disk); set
# TORCH_SPEC to choose another build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,trl,peft]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m grpo demo

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-json=benchmarks/results/cpu.json -q
	$(PY) -m benchmarks.report benchmarks/results/cpu.json

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
