"""Synthesis as the CDK CLI does it for a real account. With an account and region the app may ask
for context lookups (manifest.json `missing`); the CLI answers them with the account's values,
stores them in cdk.context.json and synthesizes again, until nothing is missing. Here the answers
come from a recorded file (real_account.context.json, for the made-up account 111122223333), so a
lookup the file does not answer fails the test, and so does any check CDK makes only once real
answers are present (the offline, answer-less synthesis of the other tests skips those).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import aws_cdk as cdk
import pytest

from scripts.stage_synth import TEST_IMAGE, cdk_json_context, run_app, stage_config
from stacks.config import StageConfig
from stacks.stages import build_stage

ACCOUNT, REGION, ZONE_ID = "111122223333", "us-west-2", "usw2-az4"
RECORDED = json.loads((Path(__file__).with_name("real_account.context.json")).read_text())
EXISTING_VPC = "vpc-0a1b2c3d4e5f67890"
EXISTING_SUBNET = "subnet-0bb00000000000002"  # a private subnet of the recorded VPC
CONTAINER_GROUP = "sg-0cc00000000000001"


def real_account_config(stage: str) -> StageConfig:
    return stage_config(stage, account=ACCOUNT, region=REGION, training_az_id=ZONE_ID)


def existing_vpc_config(subnet: str = EXISTING_SUBNET) -> StageConfig:
    cfg = real_account_config("dev")
    return replace(cfg, network=replace(cfg.network, vpc_id=EXISTING_VPC, training_subnet_id=subnet,
                                        container_security_group_id=CONTAINER_GROUP))


def missing_lookups(outdir: str) -> list[str]:
    return [m["key"] for m in json.loads((Path(outdir) / "manifest.json").read_text()).get("missing", [])]


def synth_like_cli(cfg: StageConfig, tmp_path: Path) -> tuple[list[str], dict[str, dict]]:
    """(lookups answered, template per stack name): synthesize, answer what is missing from the
    recorded file, synthesize again, as `cdk synth` does."""
    answered: dict[str, object] = {}
    for attempt in range(3):
        app = cdk.App(context={**cdk_json_context(), **answered}, outdir=str(tmp_path / f"pass{attempt}"))
        stacks = build_stage(app, cfg, image_uri=TEST_IMAGE)
        assembly = app.synth()
        missing = missing_lookups(assembly.directory)
        if not missing:
            return sorted(answered), {s.stack_name: assembly.get_stack_by_name(s.stack_name).template
                                      for s in stacks.values()}
        unanswered = [key for key in missing if key not in RECORDED]
        assert not unanswered, f"the stacks look up {unanswered}: record the CLI's answer in real_account.context.json"
        answered.update({key: RECORDED[key] for key in missing})
    raise AssertionError(f"still missing after the recorded answers: {missing}")


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_each_stage_synthesizes_for_a_real_account_without_lookups(stage, tmp_path):
    lookups, templates = synth_like_cli(real_account_config(stage), tmp_path)
    # The subnets are placed by zone ID, so no stack needs the account's zone names: `cdk synth`
    # for a real account works without credentials and writes no cdk.context.json.
    assert lookups == []
    subnets = [r["Properties"] for r in templates[f"TrnEmbed-{stage}-Network"]["Resources"].values()
               if r["Type"] == "AWS::EC2::Subnet"]
    assert subnets and all(s["AvailabilityZoneId"] == ZONE_ID and "AvailabilityZone" not in s for s in subnets)


EXISTING_VPC_LOOKUP = next(key for key in RECORDED if key.startswith("vpc-provider:"))


def test_existing_vpc_synthesizes_from_the_recorded_vpc_lookup(tmp_path):
    lookups, templates = synth_like_cli(existing_vpc_config(), tmp_path)
    assert lookups == [EXISTING_VPC_LOOKUP]
    network, storage, compute = (templates[f"TrnEmbed-dev-{role}"] for role in ("Network", "Storage", "Compute"))
    assert not [r for r in network["Resources"].values() if r["Type"] in ("AWS::EC2::VPC", "AWS::EC2::Subnet")]
    (fsx,) = [r["Properties"] for r in storage["Resources"].values() if r["Type"] == "AWS::FSx::FileSystem"]
    assert fsx["SubnetIds"] == [EXISTING_SUBNET]
    for ce in (r["Properties"] for r in compute["Resources"].values() if r["Type"] == "AWS::Batch::ComputeEnvironment"):
        assert ce["ComputeResources"]["Subnets"] == [EXISTING_SUBNET]
    # The stack changes nothing on the VPC's default group it does not own; FSx accepts its Lustre.
    rules = [r["Properties"] for r in network["Resources"].values()
             if r["Type"] in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress")]
    assert not [r for r in rules if r["GroupId"] == CONTAINER_GROUP]
    assert [r for r in rules if r.get("SourceSecurityGroupId") == CONTAINER_GROUP and r["FromPort"] == 988]


# The recorded VPC's public subnet, and a subnet of another VPC.
@pytest.mark.parametrize("subnet", ["subnet-0aa00000000000001", "subnet-0ff00000000000009"])
def test_existing_vpc_refuses_a_training_subnet_that_is_not_one_of_its_private_subnets(subnet, tmp_path):
    with pytest.raises(ValueError, match=rf"training_subnet_id='{subnet}' is not a private subnet of {EXISTING_VPC} "
                                         r"\(its private subnets: subnet-0bb00000000000001 \(us-west-2a\), "):
        synth_like_cli(existing_vpc_config(subnet), tmp_path)


def test_app_py_synthesizes_as_the_cli_runs_it_for_a_real_account(tmp_path):
    # What `npx cdk synth -c stage=dev -c training_az_id=usw2-az4` runs with credentials for the
    # account: the context (cdk.json, cdk.context.json, -c) in CDK_CONTEXT_JSON and the
    # credentials' account and region in CDK_DEFAULT_*; cdk-nag runs too.
    context = {**cdk_json_context(), **RECORDED, "stage": "dev", "training_az_id": ZONE_ID}
    result = run_app(context=json.dumps(context), outdir=tmp_path,
                     env={"CDK_DEFAULT_ACCOUNT": ACCOUNT, "CDK_DEFAULT_REGION": REGION})
    assert result.returncode == 0, result.stderr[-3000:]
    assert missing_lookups(str(tmp_path)) == []
    network = json.loads((tmp_path / "TrnEmbed-dev-Network.template.json").read_text())
    assert all(r["Properties"]["AvailabilityZoneId"] == ZONE_ID
               for r in network["Resources"].values() if r["Type"] == "AWS::EC2::Subnet")
