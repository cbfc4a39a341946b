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

.PHONY: demo test e2e venv synth infra-diff snapshots bench clean
# jsii (the CDK's Node bridge) warns on every run about Node 20's end of life; the warning is noise here.
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
STAGE ?= dev

# torch==2.9.0 + torch-xla==2.9.0 (the last Neuron training image's versions) come from the
# `local` extra; the PyPI wheel pulls ~7 GB of CUDA libraries once.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[local,infra,dev]'
	touch $(STAMP)

venv: $(STAMP)

# The whole pipeline on the bundled demo data, then the CloudFormation templates. Rerunning is
# cheap: every step resumes or skips what its run dir already holds.
demo: $(STAMP)
	$(PY) -m pipeline_steps run-local --run-dir $(RUN_DIR) --preset $(PRESET) --backend $(BACKEND)
	$(MAKE) --no-print-directory synth

test: $(STAMP)
	$(PY) -m pytest -q

# The deployed shape locally: the synthesized dev state machine in moto, every Batch job run for
# real through training_image/entrypoint.sh (docs/orchestration.md "Local end-to-end run"). The
# same scenarios run as tests/e2e/ under `make test`.
e2e: $(STAMP)
	$(PY) -m tests.e2e --work-dir runs/e2e

# Offline and deterministic: writes cdk.out/ for the stage (`make synth STAGE=prod`).
synth: $(STAMP)
	CDK_CONTEXT_JSON='{"stage":"$(STAGE)"}' $(PY) app.py

# For reviewers: what the current code changes against the committed template snapshots.
infra-diff: $(STAMP)
	$(PY) scripts/infra_diff.py

snapshots: $(STAMP)
	$(PY) scripts/infra_diff.py --update

bench: $(STAMP)
	$(PY) -m pipeline_steps bench --quick --out bench.json

clean:
	rm -rf cdk.out runs .pytest_cache
