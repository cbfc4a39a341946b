"""Service principals act only for this account (the cross-service confused deputy:
https://docs.aws.amazon.com/IAM/latest/UserGuide/confused-deputy.html), and every log group is
KMS-encrypted, on every stack of both stages."""

from __future__ import annotations

import json

import pytest

# Conditions that tie a service principal to this account's requests: the global source keys,
# or the CloudWatch Logs encryption context (the log group ARN, which names the account).
SCOPING_KEYS = {"aws:SourceAccount", "aws:SourceArn", "kms:EncryptionContext:aws:logs:arn"}
# Role trust policies this project scopes the same way (the others are EC2 instance profiles,
# ECS tasks, Step Functions, SageMaker, Scheduler: out of this check).
SCOPED_TRUSTS = {"events.amazonaws.com", "vpc-flow-logs.amazonaws.com"}


def _document(value) -> dict:
    """A policy document; a JSON string with tokens (AWS::Logs::ResourcePolicy) has them as "X"."""
    if isinstance(value, dict) and "Fn::Join" in value:
        return json.loads("".join(p if isinstance(p, str) else "X" for p in value["Fn::Join"][1]))
    return json.loads(value) if isinstance(value, str) else value


def _resource_policies(template: dict):
    keys = {"AWS::KMS::Key": "KeyPolicy", "AWS::SNS::TopicPolicy": "PolicyDocument",
            "AWS::S3::BucketPolicy": "PolicyDocument", "AWS::Logs::ResourcePolicy": "PolicyDocument"}
    for logical_id, resource in template["Resources"].items():
        if resource["Type"] in keys:
            yield logical_id, _document(resource["Properties"][keys[resource["Type"]]])
        elif resource["Type"] == "AWS::IAM::Role":
            yield logical_id, resource["Properties"]["AssumeRolePolicyDocument"]


def _services(statement: dict) -> set[str]:
    principal = statement.get("Principal")
    services = principal.get("Service", []) if isinstance(principal, dict) else []
    return set([services] if isinstance(services, str) else services)


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_every_service_principal_acts_only_for_this_account(request, stage):
    unscoped = []
    for role, template in request.getfixturevalue(f"{stage}_templates").items():
        for logical_id, document in _resource_policies(template.to_json()):
            is_trust = "AssumeRolePolicyDocument" in json.dumps(template.to_json()["Resources"][logical_id])
            for statement in document["Statement"]:
                services = _services(statement)
                if statement["Effect"] != "Allow" or not services or (is_trust and not services & SCOPED_TRUSTS):
                    continue
                keys = {key for operator in statement.get("Condition", {}).values() for key in operator}
                if not keys & SCOPING_KEYS:
                    unscoped.append(f"{role}/{logical_id}: {sorted(services)}")
    assert unscoped == []


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_every_log_group_is_kms_encrypted(request, stage):
    plain = [f"{role}/{logical_id}" for role, template in request.getfixturevalue(f"{stage}_templates").items()
             for logical_id, group in template.find_resources("AWS::Logs::LogGroup").items()
             if "KmsKeyId" not in group["Properties"]]
    assert plain == []  # including the VPC flow logs
