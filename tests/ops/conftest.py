"""The ops tests run the CLI against the synthesized pipeline executed in moto: they reuse the
orchestration tests' fixtures (tests/infra: moto_batch.py, pipeline_fixtures.py and the `aws`
fixture of test_pipeline_execution.py) instead of copying them."""

from __future__ import annotations

import sys
from pathlib import Path

INFRA_TESTS = Path(__file__).resolve().parents[1] / "infra"
if str(INFRA_TESTS) not in sys.path:
    sys.path.insert(0, str(INFRA_TESTS))

import infra_synth  # noqa: E402,F401 (repo root on sys.path, quiet jsii banner)
