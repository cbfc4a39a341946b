"""AWS service principals that act only for this account's resources: aws:SourceAccount, and
aws:SourceArn where the resource is known, on every service principal in a resource or trust policy
(the cross-service confused deputy: https://docs.aws.amazon.com/IAM/latest/UserGuide/confused-deputy.html).
"""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from constructs import Construct


def for_this_account(scope: Construct, service: str, *, source_arn: str | None = None,
                     source_arn_pattern: str | None = None) -> iam.ServicePrincipal:
    """`service` (e.g. "events.amazonaws.com") acting for this account, and for `source_arn`
    exactly (ArnEquals) or any ARN matching `source_arn_pattern` (ArnLike)."""
    conditions: dict = {"StringEquals": {"aws:SourceAccount": Stack.of(scope).account}}
    if source_arn is not None:
        conditions["ArnEquals"] = {"aws:SourceArn": source_arn}
    if source_arn_pattern is not None:
        conditions["ArnLike"] = {"aws:SourceArn": source_arn_pattern}
    return iam.ServicePrincipal(service, conditions=conditions)


def events_role(scope: Construct, construct_id: str, *, description: str) -> iam.Role:
    """A role EventBridge assumes to deliver this account's rules to a target (an SNS topic, a state
    machine), so that the topic and its KMS key need no statement for the events service principal
    (https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-use-resource-based.html: SNS targets
    may use an execution role)."""
    stack = Stack.of(scope)
    rules = stack.format_arn(service="events", resource="rule", resource_name="*")
    return iam.Role(scope, construct_id, description=description,
                    assumed_by=for_this_account(scope, "events.amazonaws.com", source_arn_pattern=rules))
