"""scripts/infra_diff.py on synthetic template pairs: what a reviewer reads (IAM and security
group tables, replacements) and the exit codes that stop a replacement of a retained resource."""

from __future__ import annotations

import copy
import json

import pytest

from scripts import infra_diff

STACK = "TrnEmbed-prod-Storage"
BASE = {"Resources": {
    "Key": {"Type": "AWS::KMS::Key", "DeletionPolicy": "Retain", "UpdateReplacePolicy": "Retain",
            "Properties": {"EnableKeyRotation": True}},
    "Data": {"Type": "AWS::S3::Bucket", "DeletionPolicy": "Retain", "UpdateReplacePolicy": "Retain",
             "Properties": {"BucketEncryption": {"ServerSideEncryptionConfiguration": []}}},
    "Fsx": {"Type": "AWS::FSx::FileSystem", "DeletionPolicy": "Retain", "UpdateReplacePolicy": "Retain",
            "Properties": {"FileSystemType": "LUSTRE", "StorageCapacity": 1200, "SubnetIds": [{"Ref": "SubnetA"}],
                           "SecurityGroupIds": [{"Fn::GetAtt": ["FsxSg", "GroupId"]}]}},
    "FsxSg": {"Type": "AWS::EC2::SecurityGroup", "Properties": {
        "GroupDescription": "fsx", "VpcId": {"Ref": "Vpc"},
        "SecurityGroupIngress": [{"IpProtocol": "tcp", "FromPort": 988, "ToPort": 988,
                                  "SourceSecurityGroupId": {"Ref": "BatchSg"}}]}},
    "Queue": {"Type": "AWS::Batch::JobQueue", "Properties": {"JobQueueName": "q", "Priority": 1}},
    "RolePolicy": {"Type": "AWS::IAM::Policy", "Properties": {
        "Roles": [{"Ref": "JobRole"}], "PolicyName": "p",
        "PolicyDocument": {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "s3:GetObject",
             "Resource": {"Fn::Join": ["", [{"Fn::GetAtt": ["Data", "Arn"]}, "/*"]]}}]}}},
}}


def changed(edit) -> dict:
    new = copy.deepcopy(BASE)
    edit(new["Resources"])
    return new


def review(new: dict, acknowledged: frozenset[str] = frozenset()) -> tuple[str, list]:
    lines, found = infra_diff.diff_template(STACK, BASE, new, acknowledged=acknowledged)
    return "\n".join(lines), found


def test_no_change_no_text() -> None:
    assert review(copy.deepcopy(BASE)) == ("", [])


def test_iam_statement_changes_are_a_table() -> None:
    def widen(res):
        res["RolePolicy"]["Properties"]["PolicyDocument"]["Statement"].append(
            {"Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject"], "Resource": "*"})
    text, found = review(changed(widen))
    assert "IAM statement changes" in text and not found
    row = next(ln for ln in text.splitlines() if ln.startswith("| ") and "s3:PutObject" in ln)
    assert row.startswith("| + | RolePolicy -> ${JobRole}") and "s3:PutObject, s3:DeleteObject" in row
    assert "| * " in row
    assert not any(ln.startswith("| - ") for ln in text.splitlines())  # the unchanged statement is not listed


def test_security_group_rule_changes_are_a_table() -> None:
    def open_ssh(res):
        rules = res["FsxSg"]["Properties"]["SecurityGroupIngress"]
        rules[0]["FromPort"] = rules[0]["ToPort"] = 1018
        rules.append({"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "CidrIp": "0.0.0.0/0"})
    text, _ = review(changed(open_ssh))
    rows = {tuple(cell.strip() for cell in ln.strip("|").split("|")) for ln in text.splitlines()
            if ln.startswith(("| + ", "| - "))}
    assert rows == {("-", "FsxSg", "in", "tcp 988", "SourceSecurityGroupId=${BatchSg}"),
                    ("+", "FsxSg", "in", "tcp 1018", "SourceSecurityGroupId=${BatchSg}"),
                    ("+", "FsxSg", "in", "tcp 22", "CidrIp=0.0.0.0/0")}


@pytest.mark.parametrize(("edit", "logical_id", "change", "because"), [
    (lambda r: r["Fsx"]["Properties"].update(SubnetIds=[{"Ref": "SubnetB"}]), "Fsx", "replaced", "SubnetIds"),
    (lambda r: r["Data"]["Properties"].update(BucketName="new-name"), "Data", "replaced", "BucketName"),
    (lambda r: r.update(KeyRenamed=r.pop("Key")), "Key", "removed", "renamed construct id?"),
    (lambda r: r.pop("Data"), "Data", "removed", "gone from the template"),
])
def test_retained_resources_replaced_or_removed_block(edit, logical_id, change, because) -> None:
    text, found = review(changed(edit))
    assert [(r.logical_id, r.change, r.retained) for r in found] == [(logical_id, change, True)]
    assert because in found[0].because
    assert "NOT ACKNOWLEDGED" in text
    assert infra_diff.blocking(found, set()) == found
    assert infra_diff.blocking(found, {f"{STACK}/{logical_id}"}) == []


def test_updates_in_place_and_unretained_replacements_do_not_block() -> None:
    def edit(res):
        res["Fsx"]["Properties"]["StorageCapacity"] = 2400  # updatable in place
        res["FsxSg"]["Properties"]["GroupDescription"] = "lustre"  # create-only, but not retained
    text, found = review(changed(edit))
    assert [(r.logical_id, r.change, r.retained) for r in found] == [("FsxSg", "replaced", False)]
    assert "GroupDescription" in text and infra_diff.blocking(found, set()) == []


@pytest.fixture
def snapshots(tmp_path, monkeypatch):
    """main() over one stage whose 'synthesis' is a synthetic template and whose snapshot is BASE."""
    path = tmp_path / f"{STACK}.json"
    path.write_text(json.dumps(BASE))
    current = {"template": copy.deepcopy(BASE)}
    monkeypatch.setattr(infra_diff, "synthesize", lambda stage: [(STACK, path, current["template"])])
    monkeypatch.setattr(infra_diff, "ACKNOWLEDGEMENTS", tmp_path / "acknowledged.json")
    return path, current


def test_exit_codes_and_update_refusal(snapshots, capsys) -> None:
    path, current = snapshots
    assert infra_diff.main(["--stage", "prod"]) == 0
    current["template"] = changed(lambda r: r["Queue"]["Properties"].update(Priority=2))
    assert infra_diff.main(["--stage", "prod"]) == infra_diff.EXIT_CHANGED
    current["template"] = changed(lambda r: r["Fsx"]["Properties"].update(FileSystemType="OPENZFS"))
    capsys.readouterr()
    assert infra_diff.main(["--stage", "prod"]) == infra_diff.EXIT_RETAINED_REPLACED
    assert f"error: {STACK}/Fsx (AWS::FSx::FileSystem, DeletionPolicy Retain) would be replaced" in \
        capsys.readouterr().err
    assert infra_diff.main(["--stage", "prod", "--update"]) == infra_diff.EXIT_RETAINED_REPLACED
    assert json.loads(path.read_text()) == BASE, "--update must not write past an unacknowledged replacement"
    assert infra_diff.main(["--stage", "prod", "--acknowledge", f"{STACK}/Fsx"]) == infra_diff.EXIT_CHANGED


def test_the_acknowledgements_file_needs_a_reason(snapshots, tmp_path) -> None:
    _, current = snapshots
    current["template"] = changed(lambda r: r.pop("Data"))
    ack = tmp_path / "acknowledged.json"
    ack.write_text(json.dumps({"acknowledged": [{"resource": f"{STACK}/Data", "reason": ""}]}))
    with pytest.raises(SystemExit, match="has no reason"):
        infra_diff.main(["--stage", "prod"])
    ack.write_text(json.dumps({"acknowledged": [{"resource": f"{STACK}/Data",
                                                 "reason": "data moved to the new bucket beforehand"}]}))
    assert infra_diff.main(["--stage", "prod", "--update"]) == 0


def test_the_committed_acknowledgements_are_well_formed() -> None:
    infra_diff.load_acknowledged()  # raises SystemExit on an entry without a reason


# ---- deploy checks: a stage of two stacks, the producer exporting what the consumer imports ------
PRODUCER, CONSUMER = "Compute", "Pipeline"
STAGE = {
    PRODUCER: {"Resources": {
        "Train": {"Type": "AWS::Batch::JobDefinition", "Properties": {"Type": "container", "ContainerProperties": {
            "Image": "repo:commit-a"}}},
        "Queue": {"Type": "AWS::Batch::JobQueue", "Properties": {"Priority": 1}},
        "Template": {"Type": "AWS::EC2::LaunchTemplate", "Properties": {"LaunchTemplateData": {"UserData": "a"}}},
        "Ce": {"Type": "AWS::Batch::ComputeEnvironment", "Properties": {
            "Type": "managed", "ReplaceComputeEnvironment": False,
            "UpdatePolicy": {"JobExecutionTimeoutMinutes": 4320, "TerminateJobsOnUpdate": False},
            "ComputeResources": {"MaxvCpus": 256, "InstanceTypes": ["trn1.32xlarge"], "LaunchTemplate": {
                "LaunchTemplateId": {"Ref": "Template"},
                "Version": {"Fn::GetAtt": ["Template", "LatestVersionNumber"]}}}}},
    }, "Outputs": {
        "TrainRef": {"Value": {"Ref": "Train"}, "Export": {"Name": "Compute:TrainRef"}},
        "QueueArn": {"Value": {"Fn::GetAtt": ["Queue", "JobQueueArn"]}, "Export": {"Name": "Compute:QueueArn"}},
        "Unused": {"Value": {"Ref": "Train"}, "Export": {"Name": "Compute:Unused"}},
    }},
    CONSUMER: {"Resources": {"Machine": {"Type": "AWS::StepFunctions::StateMachine", "Properties": {
        "Definition": {"JobDefinition": {"Fn::ImportValue": "Compute:TrainRef"},
                       "JobQueue": {"Fn::ImportValue": "Compute:QueueArn"}}}}}},
}


def next_stage(edit) -> dict:
    new = copy.deepcopy(STAGE)
    edit(new[PRODUCER])
    return new


def test_an_imported_job_definition_ref_changes_with_any_job_definition_change() -> None:
    # A job definition update registers a new revision: its Ref (the ARN with revision) changes.
    new = next_stage(lambda t: t["Resources"]["Train"]["Properties"]["ContainerProperties"].update(Image="repo:commit-b"))
    assert [(c.name, c.change, c.importers) for c in infra_diff.export_changes(STAGE, new)] == [
        ("Compute:TrainRef", "changes value", (CONSUMER,))]  # not Compute:Unused: nobody imports it
    assert infra_diff.export_changes(STAGE, next_stage(lambda t: t["Resources"]["Queue"]["Properties"].update(
        Priority=2))) == []  # a queue update keeps its ARN


def test_a_removed_or_rewritten_export_in_use_is_refused() -> None:
    new = next_stage(lambda t: t["Outputs"].pop("QueueArn"))
    assert [(c.name, c.change) for c in infra_diff.export_changes(STAGE, new)] == [("Compute:QueueArn", "removed")]
    new = next_stage(lambda t: t["Outputs"]["QueueArn"].update(Value="arn:aws:batch:::job-queue/other"))
    text = "\n".join(infra_diff.deploy_review(STAGE, new))
    assert "CloudFormation refuses" in text and "| Compute:QueueArn | changes value | Pipeline    |" in text


def test_a_new_launch_template_version_replaces_the_instances_and_says_how_long_jobs_keep_theirs() -> None:
    new = next_stage(lambda t: t["Resources"]["Template"]["Properties"]["LaunchTemplateData"].update(UserData="b"))
    (update,) = infra_diff.compute_environment_updates(PRODUCER, STAGE[PRODUCER], new[PRODUCER])
    assert (update.logical_id, update.because, update.terminate_jobs, update.grace_minutes) == (
        "Ce", "LaunchTemplate", False, 4320)
    assert "keep running up to 4320 min" in "\n".join(infra_diff.deploy_review(STAGE, new))
    # Max vCPUs is a scaling update: the instances stay.
    scaled = next_stage(lambda t: t["Resources"]["Ce"]["Properties"]["ComputeResources"].update(MaxvCpus=512))
    assert infra_diff.compute_environment_updates(PRODUCER, STAGE[PRODUCER], scaled[PRODUCER]) == []


def test_an_infrastructure_update_is_not_a_replacement_when_replace_compute_environment_is_false() -> None:
    new = next_stage(lambda t: t["Resources"]["Ce"]["Properties"]["ComputeResources"].update(InstanceTypes=["trn1n.32xlarge"]))
    assert infra_diff.replacements(PRODUCER, STAGE[PRODUCER], new[PRODUCER]) == []
    new[PRODUCER]["Resources"]["Ce"]["Properties"]["ReplaceComputeEnvironment"] = True
    assert [r.change for r in infra_diff.replacements(PRODUCER, STAGE[PRODUCER], new[PRODUCER])] == ["may be replaced"]
