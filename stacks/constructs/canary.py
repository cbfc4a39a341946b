"""Hourly canary: a small sanity job on the single-node queue (EventBridge Scheduler), a
notification when it fails, and an alarm when canaries were submitted and none succeeded.
docs/orchestration.md ("Watching: canary, stuck jobs, dashboard") describes the alarm.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_batch as batch
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_scheduler as scheduler
from aws_cdk import aws_scheduler_targets as scheduler_targets
from aws_cdk import aws_sns as sns
from constructs import Construct

from pipeline_contract import CANARY
from stacks.constructs.job_definitions import JobDefinitionRef
from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.log_delivery import encrypted_log_group, log_events_to
from stacks.constructs.notifications import event_targets
from stacks.constructs.service_principals import events_role
from stacks.pipeline_config import PipelineConfig


class Canary(Construct):
    """Public: `schedule`, `alarm`, `success_rule`, `failure_rule`."""

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig, queue: batch.IJobQueue,
                 job_definition: JobDefinitionRef, topic: sns.ITopic, key: kms.IKey,
                 ownership: JobOwnership, chat_topic: sns.ITopic | None = None) -> None:
        """`chat_topic`: the Slack channel's topic for EventBridge's notifications (notifications.py)."""
        super().__init__(scope, construct_id)
        if config.canary_interval_minutes is None:
            raise ValueError("Canary: config.canary_interval_minutes is None (the canary is disabled); "
                             "do not create the construct.")
        minutes = config.canary_interval_minutes
        submit = {
            "JobName": CANARY.name,
            "JobQueue": queue.job_queue_arn,
            "JobDefinition": job_definition.name,
            "SchedulingPriorityOverride": config.default_priority,
            "Tags": dict(ownership.tags),
        }
        if config.canary_num_nodes > 1:
            submit["NodeOverrides"] = {"NumNodes": config.canary_num_nodes}
        if queue.scheduling_policy is not None:
            submit["ShareIdentifier"] = config.production_share
        # Its own group, so the group's metrics count the canary's invocations only.
        self.schedule_group = scheduler.ScheduleGroup(self, "Group")
        self.schedule = scheduler.Schedule(
            self, "Schedule",
            schedule_group=self.schedule_group,
            schedule=scheduler.ScheduleExpression.rate(Duration.minutes(minutes)),
            description=f"Canary: sanity job on the single-node queue every {minutes} minutes",
            # The universal target calls batch:SubmitJob directly: the classic EventBridge Batch target
            # has no ShareIdentifier, and the single-node queue is fair-share
            # (https://docs.aws.amazon.com/scheduler/latest/UserGuide/managing-targets-universal.html).
            target=scheduler_targets.Universal(
                service="batch", action="submitJob",
                input=scheduler.ScheduleTargetInput.from_object(submit),
                policy_statements=[iam.PolicyStatement(
                    actions=["batch:SubmitJob"],
                    resources=[queue.job_queue_arn, job_definition.arn(self)]),
                    ownership.tag_on_submit()],
                retry_attempts=3,
            ),
        )
        # The group's name is a literal, so CloudFormation would not otherwise order the two.
        self.schedule.node.add_dependency(self.schedule_group)

        # SUCCEEDED events feed the alarm and are logged (the canary's history); FAILED ones are notified.
        detail = {"jobDefinition": job_definition.event_pattern(self), "jobQueue": [queue.job_queue_arn]}
        self.success_rule = events.Rule(
            self, "SucceededRule",
            event_pattern=events.EventPattern(source=["aws.batch"], detail_type=["Batch Job State Change"],
                                              detail={**detail, "status": ["SUCCEEDED"]}))
        log_events_to(self, self.success_rule, encrypted_log_group(self, "ResultLogs", key, days=90))
        self.failure_rule = events.Rule(
            self, "FailedRule",
            event_pattern=events.EventPattern(source=["aws.batch"], detail_type=["Batch Job State Change"],
                                              detail={**detail, "status": ["FAILED"]}),
            targets=event_targets(topic, chat_topic, events_role(self, "NotifyRole", description=(
                "EventBridge: publish failed canaries to the alert topic")), title="Canary job failed",
                text=f"Canary job {events.EventField.from_path('$.detail.jobId')} failed: "
                     f"{events.EventField.from_path('$.detail.statusReason')}"))
        self._alarm_when_not_succeeding(topic, minutes)

    def _alarm_when_not_succeeding(self, topic: sns.ITopic, minutes: int) -> None:
        # Two intervals: one late run (cold instance start) is not an outage.
        window = Duration.minutes(min(2 * minutes, 24 * 60))
        submitted = self.schedule_group.metric_attempts(statistic="Sum", period=window)
        succeeded = cw.Metric(namespace="AWS/Events", metric_name="TriggeredRules",
                              dimensions_map={"RuleName": self.success_rule.rule_name}, statistic="Sum", period=window)
        self.alarm = cw.Alarm(
            self, "NotSucceedingAlarm",
            alarm_description=f"Two canary jobs were submitted in {window.to_minutes()} minutes and none succeeded: "
                              "they failed, were not accepted, or wait in RUNNABLE (capacity).",
            metric=cw.MathExpression(
                expression="IF(FILL(submitted, 0) >= 2 AND FILL(succeeded, 0) < 1, 1, 0)",
                using_metrics={"submitted": submitted, "succeeded": succeeded},
                period=window, label="Canaries submitted without a success"),
            threshold=1, evaluation_periods=1,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            # No data = nothing submitted yet (a fresh deploy): not an outage.
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.alarm.add_alarm_action(cw_actions.SnsAction(topic))
        self.alarm.add_ok_action(cw_actions.SnsAction(topic))
