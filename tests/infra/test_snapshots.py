"""One committed JSON snapshot per stack of each stage in SNAPSHOT_STAGES (dev and prod; registry
image injected, prod with the test-only AMI pin), so the stage that is deployed is reviewed too.

A failing comparison means the infrastructure changed: review it with `make infra-diff`
(scripts/infra_diff.py), then refresh with `make snapshots` (UPDATE_SNAPSHOTS=1).
"""

from __future__ import annotations

import json
import os

import pytest

from scripts.stage_synth import SNAPSHOT_DIR, SNAPSHOT_STAGES, TEST_ONLY_AMI_ID, snapshot_path

UPDATE = os.environ.get("UPDATE_SNAPSHOTS") == "1"


@pytest.mark.parametrize("stage", SNAPSHOT_STAGES)
@pytest.mark.parametrize("name", ["network", "storage", "compute", "pipeline"])
def test_snapshot(request, template_of, stage, name):
    stack = request.getfixturevalue(f"{stage}_stage")[name]
    current = template_of(stack).to_json()
    path = snapshot_path(stack)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"no snapshot {path}: run `make snapshots` (UPDATE_SNAPSHOTS=1)"
    assert json.loads(path.read_text()) == current, (
        f"{stack.stack_name} differs from {path.name}: review with `make infra-diff`, refresh with `make snapshots`"
    )


def test_every_stage_is_snapshotted_and_prod_with_the_test_ami_pin():
    assert set(SNAPSHOT_STAGES) == {"dev", "prod"}
    names = {path.name for path in SNAPSHOT_DIR.glob("*.json")}
    for stage in SNAPSHOT_STAGES:
        for role in ("Network", "Storage", "Compute", "Pipeline"):
            assert f"TrnEmbed-{stage}-{role}.json" in names
    prod_compute = (SNAPSHOT_DIR / "TrnEmbed-prod-Compute.json").read_text()
    assert TEST_ONLY_AMI_ID in prod_compute
