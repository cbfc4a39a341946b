"""One committed JSON snapshot per stack (dev stage, registry image injected).

A failing comparison means the infrastructure changed: review it with `make infra-diff`
(scripts/infra_diff.py), then refresh with `make snapshots` (UPDATE_SNAPSHOTS=1).
"""

from __future__ import annotations

import json
import os

import pytest

from infra_synth import snapshot_path

UPDATE = os.environ.get("UPDATE_SNAPSHOTS") == "1"


@pytest.mark.parametrize("name", ["network", "storage", "compute", "pipeline"])
def test_snapshot(dev_stage, template_of, name):
    stack = dev_stage[name]
    current = template_of(stack).to_json()
    path = snapshot_path(stack)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"no snapshot {path}: run `make snapshots` (UPDATE_SNAPSHOTS=1)"
    assert json.loads(path.read_text()) == current, (
        f"{stack.stack_name} differs from {path.name}: review with `make infra-diff`, refresh with `make snapshots`"
    )
