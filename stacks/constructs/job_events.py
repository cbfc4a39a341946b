"""Batch job state changes of the pipeline's queues go to a log group (per-step durations and queue
activity on the dashboard); jobs cancelled in RUNNABLE by the queues' jobStateTimeLimitActions are
reported to the topic (https://docs.aws.amazon.com/batch/latest/userguide/batch_cwe_events.html).
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import aws_batch as batch
from aws_cdk import aws_events as events
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from constructs import Construct

from stacks.constructs.log_delivery import encrypted_log_group, log_events_to
from stacks.constructs.notifications import event_targets
from stacks.constructs.queue_wait import QUEUE_WAIT_REASON_PREFIX
from stacks.constructs.service_principals import events_role

# jobStateTimeLimitActions reasons (Batch docs use these prefixes; the compute stack sets the text),
# and the queue-wait watchdog's (stacks/constructs/queue_wait.py: every job, not only the head's).
RUNNABLE_TIMEOUT_REASON_PREFIXES = ("CAPACITY:", "MISCONFIGURATION:", QUEUE_WAIT_REASON_PREFIX)


class JobEvents(Construct):
    """Batch job state changes of the pipeline queues -> a log group; RUNNABLE cancellations -> topic.

    Public: `log_group`, `runnable_timeout_rule`.
    """

    def __init__(self, scope: Construct, construct_id: str, *, queues: Sequence[batch.IJobQueue],
                 topic: sns.ITopic, key: kms.IKey, chat_topic: sns.ITopic | None = None,
                 runnable_timeout_reason_prefixes: Sequence[str] = RUNNABLE_TIMEOUT_REASON_PREFIXES) -> None:
        """`chat_topic`: the Slack channel's topic for EventBridge's notifications (notifications.py)."""
        super().__init__(scope, construct_id)
        queue_arns = [q.job_queue_arn for q in queues]
        self.log_group = encrypted_log_group(self, "JobStateLogs", key)
        to_logs = events.Rule(self, "JobStateToLogs", event_pattern=events.EventPattern(
            source=["aws.batch"], detail_type=["Batch Job State Change"], detail={"jobQueue": queue_arns}))
        log_events_to(self, to_logs, self.log_group)
        self.runnable_timeout_rule = events.Rule(
            self, "RunnableTimeoutRule",
            description="Jobs cancelled in RUNNABLE by the queues' jobStateTimeLimitActions",
            event_pattern=events.EventPattern(
                source=["aws.batch"], detail_type=["Batch Job State Change"],
                detail={"jobQueue": queue_arns, "status": ["FAILED"],
                        "statusReason": [{"prefix": p} for p in runnable_timeout_reason_prefixes]}),
            targets=event_targets(
                topic, chat_topic, events_role(
                    self, "NotifyRole", description="EventBridge: publish RUNNABLE cancellations to the alert topic"),
                title="Batch job cancelled in RUNNABLE",
                text=f"Batch job {events.EventField.from_path('$.detail.jobName')} "
                     f"({events.EventField.from_path('$.detail.jobId')}) on queue "
                     f"{events.EventField.from_path('$.detail.jobQueue')} was cancelled in RUNNABLE (waiting too "
                     f"long): {events.EventField.from_path('$.detail.statusReason')}"))
