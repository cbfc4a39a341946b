"""One KMS-encrypted SNS topic every alarm and notification goes to. Its own key, so the key policy
can admit this account's CloudWatch alarms and CloudWatch Logs without touching the stateful storage
stack (https://docs.aws.amazon.com/sns/latest/dg/sns-key-management.html#compatibility-with-aws-services).
"""

from __future__ import annotations

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subs
from constructs import Construct

from stacks.constructs.service_principals import for_this_account


class AlertTopic(Construct):
    """KMS key + SNS topic (+ optional e-mail). Public: `key`, `topic`."""

    def __init__(self, scope: Construct, construct_id: str, *, notification_email: str | None) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.key = kms.Key(self, "Key", enable_key_rotation=True,
                           description="Pipeline notifications topic and log groups")
        # CloudWatch alarms of this account publish to the encrypted topic as the service
        # (https://docs.aws.amazon.com/sns/latest/dg/sns-key-management.html#compatibility-with-aws-services).
        # EventBridge rules publish through roles (service_principals.events_role): no statement here.
        self.key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:GenerateDataKey*"],
            principals=[for_this_account(self, "cloudwatch.amazonaws.com", source_arn_pattern=stack.format_arn(
                service="cloudwatch", resource="alarm", resource_name="*", arn_format=ArnFormat.COLON_RESOURCE_NAME))],
            resources=["*"],
        ))
        # CloudWatch Logs encrypts the pipeline's log groups with this key
        # (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html).
        self.key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
            principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
            resources=["*"],
            conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn":
                                    stack.format_arn(service="logs", resource="log-group", resource_name="*",
                                                     arn_format=ArnFormat.COLON_RESOURCE_NAME)}},
        ))
        self.topic = sns.Topic(self, "Topic", master_key=self.key, enforce_ssl=True,
                               display_name="Embedding training pipeline")
        if notification_email:
            self.topic.add_subscription(subs.EmailSubscription(notification_email))
