"""Build a stage's stacks the way the tests and the review tooling see them.

Shared by tests/infra/conftest.py (session fixtures) and scripts/infra_diff.py (snapshot diff),
so the committed snapshots, the tests and the reviewer's diff are the same synthesis:
a fixed account, the stage's pinned region, cdk.json's feature flags, and a registry image in
place of the training image asset and a fixed hash for the failure classifier's code (so asset
hashes never churn the snapshots).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

# jsii's Node.js end-of-life banner would drown the test output (Node 20 on CI boxes).
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import aws_cdk as cdk  # noqa: E402
from cdk_nag import AwsSolutionsChecks  # noqa: E402

from pipeline_steps.contract import NEURON_SDK  # noqa: E402
from stacks.config import StageConfig, get_stage  # noqa: E402
from stacks.stages import build_stage  # noqa: E402
from stacks.team_config import TeamConfig  # noqa: E402

TEST_ACCOUNT = "123456789012"
TEST_IMAGE = NEURON_SDK.training_image
# The failure classifier's code asset gets this fixed hash, so a new rule does not churn the snapshots.
TEST_DIAGNOSIS_ASSET_HASH = "test-only-failure-classifier-code"
SNAPSHOT_DIR = Path(__file__).resolve().parent / "snapshots"
SNAPSHOT_STAGES = ("dev", "prod")
"""Stages with committed template snapshots: prod is the one deployed, so reviewers see it change."""


def cdk_json_context() -> dict[str, Any]:
    return dict(json.loads((REPO_ROOT / "cdk.json").read_text())["context"])


# NOT a real image: prod requires a pinned Neuron AMI and stacks/neuron_amis.json is empty as
# committed, so the tests pin this obviously fake id for prod (never deployed anywhere).
TEST_ONLY_AMI_ID = "ami-00000000000000000"
# A zone ID of the stages' region for synthesis; a deployment passes its own (-c training_az_id).
TEST_TRAINING_AZ_ID = "use1-az6"


def stage_config(name: str, *, account: str = TEST_ACCOUNT, region: str | None = None,
                 training_az_id: str = TEST_TRAINING_AZ_ID) -> StageConfig:
    """The stage as deployed, with the test account and TEST_TRAINING_AZ_ID (or the given ones);
    prod gets TEST_ONLY_AMI_ID pinned for its region (dev keeps its real policy, so its snapshot is
    what `make synth` with that zone produces)."""
    cfg = get_stage(name).with_env(account=account, region=region, training_az_id=training_az_id)
    if name == "prod":
        pins = {**cfg.compute.neuron_ami_ids, cfg.region: TEST_ONLY_AMI_ID}
        cfg = replace(cfg, compute=replace(cfg.compute, neuron_ami_ids=pins))
    return cfg


# Two teams sharing the dev stage (tests of teams: IAM evaluation, boot quotas, the e2e quota run).
TEAM_ROLES = {"search": f"arn:aws:iam::{TEST_ACCOUNT}:role/search-scientists",
              "ads": f"arn:aws:iam::{TEST_ACCOUNT}:role/ads-engineers"}
ADMIN_ROLE = f"arn:aws:iam::{TEST_ACCOUNT}:role/platform-oncall"


def teams_stage_config(name: str = "dev", **quotas_gib: float) -> StageConfig:
    """The stage with teams `search` (weight 1, a 20% compute reservation) and `ads` (weight 2),
    each with its own principal, and an admin principal; `quotas_gib` overrides a team's FSx quota
    (default 300 GiB each)."""
    teams = (TeamConfig(name="search", weight=1.0, compute_reservation=20, fsx_quota_gib=quotas_gib.get("search", 300),
                        principals=(TEAM_ROLES["search"],)),
             TeamConfig(name="ads", weight=2.0, fsx_quota_gib=quotas_gib.get("ads", 300),
                        principals=(TEAM_ROLES["ads"],)))
    return replace(stage_config(name), teams=teams, admin_principals=(ADMIN_ROLE,))


def build(name: str, *, nag: bool = True, outdir: str | None = None,
          config: StageConfig | None = None) -> tuple[cdk.App, dict[str, cdk.Stack]]:
    """A new App with the stage's stacks (registry image injected), cdk-nag attached; `config`
    replaces the stage's config (e.g. teams_stage_config())."""
    app = cdk.App(context=cdk_json_context(), outdir=outdir)
    stacks = build_stage(app, config or stage_config(name), image_uri=TEST_IMAGE,
                         diagnosis_asset_hash=TEST_DIAGNOSIS_ASSET_HASH)
    if nag:
        cdk.Aspects.of(app).add(AwsSolutionsChecks())
    return app, stacks


def snapshot_path(stack: cdk.Stack) -> Path:
    return SNAPSHOT_DIR / f"{stack.stack_name}.json"


def template_json(app: cdk.App, stack: cdk.Stack) -> dict[str, Any]:
    """The synthesized template of `stack` (synthesizes the app once, then cached by CDK)."""
    assembly = app.synth()
    return dict(assembly.get_stack_by_name(stack.stack_name).template)


def run_app(*args: str, context: str | None, outdir: Path, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """`python app.py` the way the cdk CLI runs it: context in CDK_CONTEXT_JSON, output in
    CDK_OUTDIR, no CDK_*/AWS_* variables of the caller's shell (plus `env`)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CDK_", "AWS_"))}
    clean.update({"JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20", "CDK_OUTDIR": str(outdir), **(env or {})})
    if context is not None:
        clean["CDK_CONTEXT_JSON"] = context
    return subprocess.run([sys.executable, "app.py", *args], cwd=REPO_ROOT, env=clean, capture_output=True,
                          text=True, check=False, timeout=600)
