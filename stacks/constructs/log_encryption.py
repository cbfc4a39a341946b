"""A KMS key CloudWatch Logs may use to encrypt the log groups of one stack."""

from __future__ import annotations

from aws_cdk import ArnFormat, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct


def log_encryption_key(scope: Construct, construct_id: str, *, description: str) -> kms.Key:
    """A rotated key whose policy lets the regional CloudWatch Logs service use it, only for log
    groups of this account and region (the encryption context names the log group)
    (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html)."""
    stack = Stack.of(scope)
    key = kms.Key(scope, construct_id, enable_key_rotation=True, description=description,
                  # Retained with the log groups it encrypts (they are retained too).
                  removal_policy=RemovalPolicy.RETAIN)
    key.add_to_resource_policy(iam.PolicyStatement(
        actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
        principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
        resources=["*"],
        conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn": stack.format_arn(
            service="logs", resource="log-group", resource_name="*", arn_format=ArnFormat.COLON_RESOURCE_NAME)}},
    ))
    return key
