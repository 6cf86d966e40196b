# Two commands for a new user: `make demo` and `make test`. Both create .venv and install into it.
# On a machine without a GPU, torch==2.13.0 is the CPU build (this machine keeps it on disk); set
# TORCH_SPEC to choose another build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test bench bench-ci clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,trl]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m grpo demo

test: install
	$(PY) -m pytest -q tests
	$(MAKE) --no-print-directory bench-ci

# After the tests, CI proves the benchmarks (~3 min on 2 cores): every smoke case once, each checked
# against the reference; then gpu_check.sh end to end on the CPU (smoke set, `trainer_step --quick`),
# which must exit 0 and write its report. One thread: tiny shapes, and two spin-wait on a loaded machine.
BENCH_CI_DIR ?= /tmp/grpo-bench-ci
bench-ci: install
	GRPO_BENCH_SET=smoke OMP_NUM_THREADS=1 $(PY) -m pytest benchmarks/ --benchmark-disable -q -p no:cacheprovider \
		--ignore=benchmarks/bench_long_context.py
	rm -rf $(BENCH_CI_DIR)
	GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_SET=smoke GPU_CHECK_KERNEL_TESTS=0 OMP_NUM_THREADS=1 PYTHON=$(abspath $(PY)) \
		bash benchmarks/gpu_check.sh $(BENCH_CI_DIR)
	test -s $(BENCH_CI_DIR)/gpu.md && test -s $(BENCH_CI_DIR)/gpu.json && ls $(BENCH_CI_DIR)/trainer_step-*.md

bench: install
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-json=benchmarks/results/cpu.json -q
	$(PY) -m benchmarks.report benchmarks/results/cpu.json

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
