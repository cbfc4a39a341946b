"""scripts/infra_pin_ami.sh writes the pin file stacks/config.py reads (fake `aws` on PATH)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from infra_synth import REPO_ROOT
from stacks.config import load_pinned_amis

SCRIPT = REPO_ROOT / "scripts" / "infra_pin_ami.sh"
SSM_VALUE = {"image_id": "ami-0123456789abcdef0", "ecs_agent_version": "1.99.0", "os": "Amazon Linux 2023",
             "image_name": "al2023-ami-ecs-neuron-hvm-2023.0.20990101-kernel-6.1-x86_64"}


def _run(tmp_path: Path, *regions: str, value: dict = SSM_VALUE) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "aws"
    fake.write_text("#!/usr/bin/env bash\n"
                    'echo "$*" >> "$(dirname "$0")/calls"\n'
                    f"cat <<'JSON'\n{json.dumps(value)}\nJSON\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "NEURON_AMIS_FILE": str(tmp_path / "pins.json"), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), *regions], env=env, capture_output=True, text=True, check=False)


def test_pins_each_region_with_name_and_date(tmp_path):
    (tmp_path / "pins.json").write_text(json.dumps({"us-west-2": {
        "image_id": "ami-0aaaaaaaaaaaaaaaa", "image_name": "al2023-ami-ecs-neuron-hvm-2023.0.20260501-kernel-6.1-x86_64",
        "pinned_at": "2026-05-02"}}))
    result = _run(tmp_path, "us-east-1")
    assert result.returncode == 0, result.stderr
    pins = json.loads((tmp_path / "pins.json").read_text())
    assert set(pins) == {"us-east-1", "us-west-2"}  # other regions kept
    assert pins["us-east-1"]["image_id"] == SSM_VALUE["image_id"]
    assert pins["us-east-1"]["image_name"] == SSM_VALUE["image_name"]
    assert len(pins["us-east-1"]["pinned_at"]) == 10
    calls = (tmp_path / "bin" / "calls").read_text()
    assert "--region us-east-1" in calls
    assert "/aws/service/ecs/optimized-ami/amazon-linux-2023/neuron/recommended" in calls
    assert dict(load_pinned_amis(tmp_path / "pins.json"))["us-east-1"] == SSM_VALUE["image_id"]


def test_refuses_a_bad_ssm_value(tmp_path):
    result = _run(tmp_path, "us-east-1", value={"image_id": "nope"})
    assert result.returncode != 0 and "unexpected SSM value" in result.stderr
    assert not (tmp_path / "pins.json").exists()


def test_needs_a_region(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 2 and "usage" in result.stderr


def test_refuses_an_ami_older_than_the_training_images_neuron_driver(tmp_path):
    old = {**SSM_VALUE, "image_name": "al2023-ami-ecs-neuron-hvm-2023.0.20251015-kernel-6.1-x86_64"}
    result = _run(tmp_path, "us-east-1", value=old)
    assert result.returncode != 0 and "built 2025-10-15, before Neuron driver" in result.stderr
    assert not (tmp_path / "pins.json").exists()
