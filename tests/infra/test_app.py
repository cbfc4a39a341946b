"""app.py reads the stage the way the cdk CLI passes it (CDK_CONTEXT_JSON) and refuses the
`python app.py -c stage=prod` form that plain python would silently ignore."""

from __future__ import annotations

import subprocess

import pytest

from scripts.stage_synth import REPO_ROOT, run_app


def _app(*args: str, context: str | None = None, tmp_path) -> subprocess.CompletedProcess[str]:
    return run_app(*args, context=context, outdir=tmp_path / "cdk.out")


def test_command_line_context_is_refused_with_the_usage(tmp_path):
    result = _app("-c", "stage=prod", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "CDK_CONTEXT_JSON='{\"stage\":\"prod\",\"training_az_id\":\"<zone id>\"}' python app.py" in result.stderr


@pytest.mark.parametrize(("context", "expected"), [
    # prod (and the region) are honoured: prod fails on its AMI policy (no pin for that region),
    # which dev would not.
    ('{"stage":"prod","region":"eu-north-1","training_az_id":"eun1-az1"}',
     "Stage 'prod': no Neuron AMI pinned for region 'eu-north-1'"),
    # The training zone comes from the context, by ID, checked against the region.
    ('{"stage":"dev"}', "Stage 'dev': no training zone"),
    ('{"stage":"dev","training_az_id":"us-east-1a"}', "training_az_id='us-east-1a' is not a zone ID"),
    ('{"stage":"dev","region":"eu-north-1","training_az_id":"use1-az6"}', "is not a zone of region 'eu-north-1'"),
    ('{"stage":"qa"}', "Unknown stage 'qa'"),
])
def test_stage_comes_from_cdk_context_json(tmp_path, context, expected):
    result = _app(context=context, tmp_path=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_git_head_is_the_checkout_commit():
    import app as cdk_app

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert cdk_app.git_head() == head.stdout.strip()
