"""Where the pipeline's helpers log: KMS-encrypted log groups, EventBridge rule delivery into a log
group, and Express state machines that log every execution.
"""

from __future__ import annotations

import jsii

from aws_cdk import ArnFormat, Duration, RemovalPolicy, Stack
from aws_cdk import aws_events as events
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.constructs.retention import retention_days
from stacks.constructs.service_principals import for_this_account


def encrypted_log_group(scope: Construct, construct_id: str, key: kms.IKey, days: int = 365) -> logs.LogGroup:
    return logs.LogGroup(scope, construct_id, encryption_key=key, retention=retention_days(days),
                         removal_policy=RemovalPolicy.RETAIN)


@jsii.implements(events.IRuleTarget)
class _LogGroupTarget:
    def __init__(self, log_group: logs.ILogGroup) -> None:
        self._log_group = log_group

    def bind(self, rule: events.IRule, id: str | None = None) -> events.RuleTargetConfig:  # noqa: A002
        return events.RuleTargetConfig(arn=Stack.of(rule).format_arn(
            service="logs", resource="log-group", resource_name=self._log_group.log_group_name,
            arn_format=ArnFormat.COLON_RESOURCE_NAME))


def log_events_to(scope: Construct, rule: events.Rule, log_group: logs.ILogGroup) -> None:
    """Deliver a rule's events to a log group.

    Not `targets.CloudWatchLogGroup`: that target installs its resource policy with a custom
    resource (a Lambda); a plain AWS::Logs::ResourcePolicy does the same declaratively
    (https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-use-resource-based.html#eb-cloudwatchlogs-permissions),
    for this rule only (CloudWatch Logs supports aws:SourceArn and aws:SourceAccount:
    https://docs.aws.amazon.com/AmazonCloudWatchLogs/latest/APIReference/API_PutResourcePolicy.html).
    """
    logs.ResourcePolicy(scope, f"{rule.node.id}LogsPolicy", policy_statements=[iam.PolicyStatement(
        principals=[for_this_account(scope, "events.amazonaws.com", source_arn=rule.rule_arn)],
        actions=["logs:CreateLogStream", "logs:PutLogEvents"],
        resources=[log_group.log_group_arn])])
    rule.add_target(_LogGroupTarget(log_group))


def express_state_machine(scope: Construct, construct_id: str, *, definition: sfn.IChainable,
                          log_group: logs.ILogGroup, comment: str) -> sfn.StateMachine:
    """An Express state machine with full logging and tracing (cdk-nag SF1/SF2)."""
    return sfn.StateMachine(
        scope, construct_id,
        definition_body=sfn.DefinitionBody.from_chainable(definition),
        state_machine_type=sfn.StateMachineType.EXPRESS,
        timeout=Duration.minutes(5),
        tracing_enabled=True,
        logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        comment=comment,
    )
