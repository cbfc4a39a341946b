"""The queue-wait bound for every job of the pipeline's queues, not only the one at their head.

A queue's jobStateTimeLimitActions cancel a job only after it has been at the head of the queue in
RUNNABLE for maxTimeSeconds (https://docs.aws.amazon.com/batch/latest/APIReference/API_JobStateTimeLimitAction.html),
so a job queued behind others can wait longer than the queue wait every Batch state's timeout is
derived from. Here each RUNNABLE event starts a Standard execution that waits that bound and, if the
same attempt still waits, cancels the job with a reason starting QUEUE_WAIT_REASON_PREFIX. The run's
Batch state then fails and the one failure notification carries that reason (as does JobEvents).
docs/orchestration.md ("Timeline of a multi-node step") has the timeline this keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Duration
from aws_cdk import aws_batch as batch
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.log_delivery import encrypted_log_group
from stacks.constructs.service_principals import events_role

QUEUE_WAIT_REASON_PREFIX = "QUEUE_WAIT:"


class QueueWaitLimit(Construct):
    """Public: `state_machine`, `rule`, `reason` (the cancellation's status reason)."""

    def __init__(self, scope: Construct, construct_id: str, *, queues: Sequence[batch.IJobQueue],
                 queue_wait: Duration, ownership: JobOwnership, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        minutes = int(queue_wait.to_minutes())
        self.reason = (f"{QUEUE_WAIT_REASON_PREFIX} RUNNABLE for {minutes} minutes, the pipeline's queue-wait bound "
                       "(the queue's own limit acts only on the job at its head)")
        route = sfn.Choice(self, "Route")
        # Multi-node jobs also emit one event per node (with nodeDetails); the parent job is watched.
        route.when(sfn.Condition.is_present("$.detail.nodeDetails"), sfn.Succeed(self, "IgnoreNodeEvent"))
        route.otherwise(self._bound(queue_wait))
        self.state_machine = sfn.StateMachine(
            self, "StateMachine",
            definition_body=sfn.DefinitionBody.from_chainable(route),
            state_machine_type=sfn.StateMachineType.STANDARD,  # it waits; Express ends after 5 minutes
            timeout=Duration.minutes(minutes + 60),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=encrypted_log_group(self, "Logs", key), level=sfn.LogLevel.ALL,
                                include_execution_data=True),
            comment="Cancels a pipeline job still RUNNABLE (same attempt) after the queue-wait bound")
        role = self.state_machine.role
        # DescribeJobs has no resource-level permissions; CancelJob only this pipeline's jobs (tags).
        role.add_to_principal_policy(iam.PolicyStatement(actions=["batch:DescribeJobs"], resources=["*"]))
        role.add_to_principal_policy(ownership.act_on_jobs("batch:CancelJob"))
        self.rule = events.Rule(
            self, "RunnableRule",
            description="A job of the pipeline's queues entered RUNNABLE: bound its wait",
            event_pattern=events.EventPattern(
                source=["aws.batch"], detail_type=["Batch Job State Change"],
                detail={"jobQueue": [q.job_queue_arn for q in queues], "status": ["RUNNABLE"]}),
            targets=[targets.SfnStateMachine(self.state_machine, retry_attempts=8, role=events_role(
                self, "StartRole", description="EventBridge: start the queue-wait watchdog on RUNNABLE jobs"))])

    def _bound(self, queue_wait: Duration) -> sfn.IChainable:
        """WaitRecord -> WaitQueueBound -> DescribeWaitingJob -> StillWaiting -> (CountAttempts ->
        SameAttempt) -> CancelWaitingJob | MovedOn."""
        record = sfn.CustomState(self, "WaitRecord", state_json={
            "Type": "Pass",
            # An array child's id is <parent>:<index>: the parent is cancelled (the step fails anyway).
            "Parameters": {"job_id.$": "$.detail.jobId",
                           "cancel_id.$": "States.ArrayGetItem(States.StringSplit($.detail.jobId, ':'), 0)",
                           "attempts.$": "States.ArrayLength($.detail.attempts)"},
        })
        wait = sfn.Wait(self, "WaitQueueBound", time=sfn.WaitTime.duration(queue_wait))
        describe = sfn.CustomState(self, "DescribeWaitingJob", state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:batch:describeJobs",
            "Parameters": {"Jobs.$": "States.Array($.job_id)"},
            "ResultSelector": {"record.$": "$.Jobs[0]"},
            "ResultPath": "$.job",
        })
        count = sfn.CustomState(self, "CountAttempts", state_json={
            "Type": "Pass", "Parameters": {"now.$": "States.ArrayLength($.job.record.Attempts)"},
            "ResultPath": "$.count"})
        cancel = sfn.CustomState(self, "CancelWaitingJob", state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:batch:cancelJob",
            "Parameters": {"JobId.$": "$.cancel_id", "Reason": self.reason},
            "ResultPath": "$.result",
        })
        for task in (describe, cancel):
            task.add_retry(errors=["States.TaskFailed", "States.Timeout"], interval=Duration.seconds(2), max_attempts=3,
                           backoff_rate=2.0, jitter_strategy=sfn.JitterType.FULL)
        moved_on, same_attempt = sfn.Succeed(self, "MovedOn"), sfn.Choice(self, "SameAttempt")
        still_waiting = sfn.Choice(self, "StillWaiting")
        record.next(wait)
        wait.next(describe)
        describe.next(still_waiting)
        # A retry re-enters RUNNABLE with one more attempt; its own event bounds its own wait.
        still_waiting.when(sfn.Condition.not_(sfn.Condition.string_equals("$.job.record.Status", "RUNNABLE")), moved_on)
        still_waiting.when(sfn.Condition.is_present("$.job.record.Attempts"), count)
        still_waiting.when(sfn.Condition.number_equals("$.attempts", 0), cancel)
        still_waiting.otherwise(moved_on)
        count.next(same_attempt)
        same_attempt.when(sfn.Condition.number_equals_json_path("$.count.now", "$.attempts"), cancel)
        same_attempt.otherwise(moved_on)
        cancel.next(sfn.Succeed(self, "Cancelled"))
        return record
