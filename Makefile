# Two commands matter (README quick start): `make demo` and `make test`. Both create .venv and
# install what they need first, so they work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/demo
PRESET ?= small
BACKEND ?= cpu

.PHONY: demo test venv synth infra-diff snapshots bench clean

# torch==2.9.0 + torch-xla==2.9.0 (the last Neuron training image's versions) come from the
# `local` extra; the PyPI wheel pulls ~7 GB of CUDA libraries once.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[local,infra,dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP) synth
	$(PY) -m pipeline_steps run-local --run-dir $(RUN_DIR) --preset $(PRESET) --backend $(BACKEND)

test: $(STAMP)
	$(PY) -m pytest -q

synth: $(STAMP)
	$(PY) app.py

bench: $(STAMP)
	$(PY) -m pipeline_steps bench --quick --out bench.json

clean:
	rm -rf cdk.out runs .pytest_cache
