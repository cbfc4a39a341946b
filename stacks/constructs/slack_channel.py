"""The notification topic in a Slack channel through AWS Chatbot (optional, per stage), and a second
topic only the channel subscribes to, for what EventBridge rules render for chat (notifications.py).

Notifications only: the channel role has no permissions and the guardrail (CloudWatch read-only,
which caps the channel role and every user role) lets nobody act on the account from Slack; an
SNS message needs no permission to be delivered
(https://docs.aws.amazon.com/chatbot/latest/adminguide/understanding-permissions.html). Chatbot
logs delivery errors to /aws/chatbot/<name> in us-east-1, kept as long as the stage's logs.
The workspace must be authorized once in the Chatbot console before the first deploy.
"""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_chatbot as chatbot
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from cdk_nag import NagSuppressions
from constructs import Construct

from stacks.constructs.retention import retention_days

# An AWS managed policy Chatbot documents as a guardrail: read-only, and only CloudWatch
# (https://docs.aws.amazon.com/chatbot/latest/adminguide/chatbot-iam-policies.html).
GUARDRAIL_POLICY = "CloudWatchReadOnlyAccess"


class SlackChannel(Construct):
    """A Chatbot Slack channel configuration subscribed to `topic` and to `chat_topic` (encrypted with
    `key`, as `topic`). Public: `configuration`, `chat_topic`."""

    def __init__(self, scope: Construct, construct_id: str, *, workspace_id: str, channel_id: str,
                 topic: sns.ITopic, key: kms.IKey, log_retention_days: int) -> None:
        super().__init__(scope, construct_id)
        self.chat_topic = sns.Topic(self, "ChatTopic", master_key=key, enforce_ssl=True,
                                    display_name="Embedding training pipeline (Slack)")
        self.configuration = chatbot.SlackChannelConfiguration(
            self, "Configuration",
            slack_channel_configuration_name=f"{Stack.of(self).stack_name}-notifications",
            slack_workspace_id=workspace_id, slack_channel_id=channel_id,
            notification_topics=[topic, self.chat_topic],
            guardrail_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(GUARDRAIL_POLICY)],
            user_role_required=False,
            logging_level=chatbot.LoggingLevel.ERROR,
            log_retention=retention_days(log_retention_days),
        )
        # CDK's LogRetention function sets the retention of /aws/chatbot/<name> (the group exists
        # only in us-east-1, so no LogGroup of this stack can own it); it is a stack singleton.
        stack = Stack.of(self)
        (provider,) = [c for c in stack.node.children
                       if c.node.id.startswith("LogRetention") and c.node.try_find_child("ServiceRole")]
        NagSuppressions.add_resource_suppressions(provider, [
            {"id": "AwsSolutions-IAM4", "reason": "CDK's LogRetention function writes its own logs with "
             "AWSLambdaBasicExecutionRole.",
             "appliesTo": ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"]},
            {"id": "AwsSolutions-IAM5", "reason": "CDK's LogRetention function sets the retention of Chatbot's log "
             "group, which lives in us-east-1 whatever the stack's region; logs:PutRetentionPolicy is granted on "
             "'*' by CDK.", "appliesTo": ["Resource::*"]},
        ], apply_to_children=True)
