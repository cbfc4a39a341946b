"""scripts/infra_diff.py on synthetic template pairs: what a reviewer reads (IAM and security
group tables, replacements) and the exit codes that stop a replacement of a retained resource."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import pytest

from infra_synth import REPO_ROOT

_spec = importlib.util.spec_from_file_location("infra_diff", REPO_ROOT / "scripts" / "infra_diff.py")
infra_diff = sys.modules["infra_diff"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(infra_diff)

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
