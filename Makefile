# Two commands matter (README quick start): `make demo` and `make test`. Both create .venv and
# install what they need first, so they work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PRESET ?= small
BACKEND ?= cpu
# One run dir per preset and backend: every step resumes what its run dir holds, so a second
# `make demo PRESET=tiny` or `BACKEND=xla` must not land in the first run's directory.
RUN_DIR ?= runs/demo-$(PRESET)-$(BACKEND)

.PHONY: demo check-node test e2e venv synth infra-diff snapshots bench clean cdk-cli cdk lock failure-model
# jsii (the CDK's Node bridge) warns on every run about Node 20's end of life; the warning is noise here.
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
STAGE ?= dev
# A zone ID for offline synthesis only (what `make synth`/`make demo` write is never deployed).
# Deploys pass their own with `make cdk ARGS="deploy -c training_az_id=..."`, which has no default
# (docs/infrastructure.md, "Training zone by ID").
AZ_ID ?= use1-az6

# torch==2.9.0 + torch-xla==2.9.0 (the last Neuron training image's versions) come from the
# `local` extra; the PyPI wheel pulls ~7 GB of CUDA libraries once. The infra and ops libraries are
# held at deploy-constraints.txt, so the tests check exactly the set `make cdk` deploys with.
$(STAMP): pyproject.toml deploy-constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c deploy-constraints.txt -e '.[local,infra,dev]'
	touch $(STAMP)

venv: $(STAMP)

# The whole pipeline on the bundled demo data, then the CloudFormation templates. Rerunning is
# cheap: every step resumes or skips what its run dir already holds.
demo: check-node $(STAMP)
	$(PY) -m pipeline_steps run-local --run-dir $(RUN_DIR) --preset $(PRESET) --backend $(BACKEND)
	$(MAKE) --no-print-directory synth

# Before the long install and training: synthesis at the end of the demo needs Node.js.
check-node:
	@$(PYTHON) scripts/check_node.py

# On one worker more than cores (pytest-xdist; tests that share an expensive fixture stay on one worker: see
# tests/conftest.py), and the slowest tests listed at the end.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadgroup --durations=15

# The deployed shape locally: the synthesized dev state machine in moto, every Batch job run for
# real through training_image/entrypoint.sh (docs/orchestration.md "Local end-to-end run"). The
# same scenarios run as tests/e2e/ under `make test`.
e2e: $(STAMP)
	$(PY) -m tests.e2e --work-dir runs/e2e

# Offline and deterministic: writes cdk.out/ for the stage (`make synth STAGE=prod`).
synth: $(STAMP)
	CDK_CONTEXT_JSON='{"stage":"$(STAGE)","training_az_id":"$(AZ_ID)"}' $(PY) app.py

# For reviewers: what the current code changes against the committed template snapshots.
infra-diff: $(STAMP)
	$(PY) -m scripts.infra_diff

snapshots: $(STAMP)
	$(PY) -m scripts.infra_diff --update

# ---- deploys: the pinned CDK CLI (package-lock.json) and the locked Python set (deploy-constraints.txt)
CDK := node_modules/.bin/cdk
DEPLOY_VENV := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed

$(CDK): package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $(CDK)

cdk-cli: check-node $(CDK)

$(DEPLOY_STAMP): pyproject.toml deploy-constraints.txt
	test -x $(DEPLOY_VENV)/bin/python || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DEPLOY_VENV)/bin/python -m pip install --quiet -c deploy-constraints.txt '.[infra,ops]'
	touch $(DEPLOY_STAMP)

# Any CDK CLI command with the pinned CLI and the locked libraries (cdk.json runs `python3 app.py`,
# the deploy venv's python3 here): make cdk ARGS="diff -c stage=prod -c training_az_id=use1-az6"
cdk: cdk-cli $(DEPLOY_STAMP)
	PATH="$(CURDIR)/$(DEPLOY_VENV)/bin:$$PATH" $(CDK) $(ARGS)

# After an intended dependency upgrade in .venv: rewrite deploy-constraints.txt from it.
lock: $(STAMP)
	$(PY) scripts/lock_deploy.py

# After adding cases to the failure corpus: fit the classifier's log model on it again.
failure-model: $(STAMP)
	$(PY) -m scripts.failure_model

bench: $(STAMP)
	$(PY) -m benchmarks.bench --quick --out bench.json

clean:
	rm -rf cdk.out runs .pytest_cache $(DEPLOY_VENV)
