"""Stall watchdog: a training job that stops emitting its progress heartbeat is terminated.

EventBridge and a Standard state machine with SDK integrations (no Lambda) put a per-job alarm on
the run's heartbeat once its first heartbeat arrived (or PipelineConfig.first_heartbeat_minutes
passed without one), and terminate the job when it fires. The in-process watchdog
(pipeline_steps/watchdog.py) covers the common case by exiting with the retryable code; this
covers a process too frozen to exit. docs/orchestration.md ("The stall watchdog") has the states
and the timing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from aws_cdk import ArnFormat, Duration, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from pipeline_contract import (
    HEARTBEAT_NAMESPACE,
    HEARTBEAT_RUN_DIMENSION,
    HEARTBEAT_STAGE_DIMENSION,
    HEARTBEAT_STEP_METRIC,
    RUN_ID_PARAMETER,
)
from stacks.constructs.job_definitions import JobDefinitionRef
from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.log_delivery import encrypted_log_group
from stacks.constructs.notifications import compose, publish_state
from stacks.constructs.service_principals import events_role
from stacks.pipeline_config import PipelineConfig

# Where the Batch "Job State Change" event carries the run id: the job's `run_id` parameter, its only
# run identity. It is exactly what the job emits as the heartbeat's RunId dimension: the job
# definitions run `--run-dir /fsx/runs/Ref::run_id`, training_image/entrypoint.sh exports
# PIPELINE_RUN_ID = the run dir below /fsx/runs (= run_id, `<team>/<name>` for a team's run), and
# pipeline_steps/heartbeat.py publishes it. So the
# alarm watches this run's series only, and a healthy concurrent run of the same stage cannot hide
# a stalled one.
JOB_EVENT_RUN_ID_PATH = f"$.detail.parameters.{RUN_ID_PARAMETER}"
# How often the arm path looks for the run's first heartbeat: the alarm is put at most this long
# (plus EMF ingestion) after it, well inside the alarm's own stall_timeout_minutes (5 or more).
HEARTBEAT_POLL_MINUTES = 2


class StallWatchdog(Construct):
    """Per-job heartbeat alarms for the Train job definitions (one per team) and termination on ALARM: one
    execution per event, routed to arm (Batch RUNNING, on the first heartbeat, while the same
    attempt runs), terminate (CloudWatch ALARM, if the job still runs) or disarm (any other
    Batch status). Public: `state_machine`, `alarm_prefix`, `rules`.
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig, stage: str,
                 train_job_definitions: Sequence[JobDefinitionRef], training_queue: batch.IJobQueue,
                 ownership: JobOwnership, topic: sns.ITopic, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self._config, self._stage, self._topic = config, stage, topic
        self._queue, self._ownership = training_queue, ownership
        # '/' separates the job id: alarm names allow it, job ids and stack names never contain it.
        self.alarm_prefix = f"{stack.stack_name}-TrainStalled"

        route = sfn.Choice(self, "Route")
        # Multi-node jobs also emit one event per node (with nodeDetails); watch the parent only.
        route.when(sfn.Condition.is_present("$.detail.nodeDetails"), sfn.Succeed(self, "IgnoreNodeEvent"))
        route.when(sfn.Condition.string_equals("$.source", "aws.cloudwatch"), self._terminate_path())
        # A train job without a run_id parameter cannot start (the entrypoint refuses the literal
        # Ref::run_id with exit 78), so there is no run to watch.
        route.when(sfn.Condition.and_(sfn.Condition.string_equals("$.detail.status", "RUNNING"),
                                      sfn.Condition.is_present(JOB_EVENT_RUN_ID_PATH),
                                      sfn.Condition.is_present("$.detail.startedAt")), self._arm_path())
        route.when(sfn.Condition.string_equals("$.detail.status", "RUNNING"), sfn.Succeed(self, "NoRunIdToWatch"))
        route.otherwise(self._disarm("DisarmStallAlarm", "States.Format('" + self.alarm_prefix + "/{}', $.detail.jobId)"))

        log_group = encrypted_log_group(self, "Logs", key)
        self.state_machine = sfn.StateMachine(
            self, "StateMachine",
            definition_body=sfn.DefinitionBody.from_chainable(route),
            state_machine_type=sfn.StateMachineType.STANDARD,  # it waits; Express ends after 5 minutes
            timeout=Duration.minutes(config.first_heartbeat_minutes + 60),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            comment="Arms per-job training heartbeat alarms on the first heartbeat, terminates stalled jobs")
        role = self.state_machine.role
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["cloudwatch:PutMetricAlarm", "cloudwatch:DeleteAlarms"],
            resources=[stack.format_arn(service="cloudwatch", resource="alarm",
                                        resource_name=f"{self.alarm_prefix}/*", arn_format=ArnFormat.COLON_RESOURCE_NAME)]))
        # GetMetricData and DescribeJobs have no resource-level permissions
        # (https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazoncloudwatch.html,
        # https://docs.aws.amazon.com/batch/latest/userguide/batch-supported-iam-actions-resources.html).
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["cloudwatch:GetMetricData", "batch:DescribeJobs"], resources=["*"]))
        role.add_to_principal_policy(ownership.act_on_jobs("batch:TerminateJob"))
        topic.grant_publish(role)

        target = targets.SfnStateMachine(self.state_machine, retry_attempts=8, role=events_role(
            self, "StartRole", description="EventBridge: start the stall watchdog on train job and alarm events"))
        self.rules = [
            events.Rule(self, "TrainJobStateRule", targets=[target], event_pattern=events.EventPattern(
                source=["aws.batch"], detail_type=["Batch Job State Change"],
                # RUNNABLE/STARTING: a retry attempt; its alarm goes until its own RUNNING arms it.
                detail={"jobDefinition": [p for job in train_job_definitions for p in job.event_pattern(self)],
                        "status": ["RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED"]})),
            events.Rule(self, "StallAlarmRule", targets=[target], event_pattern=events.EventPattern(
                source=["aws.cloudwatch"], detail_type=["CloudWatch Alarm State Change"],
                detail={"alarmName": [{"prefix": f"{self.alarm_prefix}/"}], "state": {"value": ["ALARM"]}})),
        ]

    # ---- arm: on the first heartbeat (or past the first-heartbeat bound), if the attempt still runs
    def _arm_path(self) -> sfn.IChainable:
        """WatchRecord -> (WaitForHeartbeat -> DescribeWatchedJob -> StillThisAttempt -> ReadFirstHeartbeat
        -> HeartbeatSeen -> PollsLeft -> CountPoll)* -> ArmStallAlarm. CloudWatch sends no event for a
        metric's first data point, so the run's heartbeat is polled."""
        # The first poll comes after one wait: the last one ends at or just past the bound.
        polls = math.ceil(self._config.first_heartbeat_minutes / HEARTBEAT_POLL_MINUTES) - 1
        record = self._raw("WatchRecord", {
            "Type": "Pass",
            # `watch` travels in the alarm's description, so the ALARM event carries everything the
            # terminate path needs (a CloudWatch Alarm State Change event has the description).
            "Parameters": {"watch": {"run_id.$": JOB_EVENT_RUN_ID_PATH, "job_id.$": "$.detail.jobId",
                                     "job_started_at.$": "$.time", "started_at_ms.$": "$.detail.startedAt"},
                           "polls_left": polls},
        })
        wait = sfn.Wait(self, "WaitForHeartbeat", time=sfn.WaitTime.duration(Duration.minutes(HEARTBEAT_POLL_MINUTES)))
        describe = self._describe_job("DescribeWatchedJob", "$.watch.job_id")
        same_attempt = sfn.Choice(self, "StillThisAttempt")
        read = self._raw("ReadFirstHeartbeat", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:getMetricData",
            "Parameters": {"MetricDataQueries": [self._heartbeat_query("SampleCount", 60)],
                           "StartTime.$": "$.watch.job_started_at", "EndTime.$": "$$.State.EnteredTime"},
            "ResultSelector": {"query.$": "States.ArrayGetItem($.MetricDataResults, 0)"},
            "ResultPath": "$.heartbeat",
        })
        self._retry(read)
        seen, polls_left = sfn.Choice(self, "HeartbeatSeen"), sfn.Choice(self, "PollsLeft")
        count = self._raw("CountPoll", {"Type": "Pass", "Parameters": {
            "watch.$": "$.watch", "polls_left.$": "States.MathAdd($.polls_left, -1)"}})
        arm = self._arm_alarm()
        record.next(wait)
        wait.next(describe)
        describe.next(same_attempt)
        ended = sfn.Succeed(self, "AttemptEnded")
        # Rules are tried in order: only a RUNNING record (which has StartedAt) reaches the second.
        same_attempt.when(sfn.Condition.not_(sfn.Condition.string_equals("$.job.record.Status", "RUNNING")), ended)
        same_attempt.when(sfn.Condition.number_equals_json_path("$.job.record.StartedAt", "$.watch.started_at_ms"), read)
        same_attempt.otherwise(ended)
        read.next(seen)
        seen.when(sfn.Condition.is_present("$.heartbeat.query.Values[0]"), arm)
        # Past the bound without any heartbeat: the alarm, all of its data missing, fires at once.
        seen.otherwise(polls_left.when(sfn.Condition.number_greater_than("$.polls_left", 0), count).otherwise(arm))
        count.next(wait)
        arm.next(sfn.Succeed(self, "Armed"))
        return record

    def _arm_alarm(self) -> sfn.CustomState:
        minutes = self._config.stall_timeout_minutes
        arm = self._raw("ArmStallAlarm", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:putMetricAlarm",
            "Parameters": {
                "AlarmName.$": f"States.Format('{self.alarm_prefix}/{{}}', $.watch.job_id)",
                "AlarmDescription.$": "States.JsonToString($.watch)",
                "Namespace": HEARTBEAT_NAMESPACE,
                "MetricName": HEARTBEAT_STEP_METRIC,
                # This run's series only (JOB_EVENT_RUN_ID_PATH says why the values match).
                "Dimensions": self._run_dimensions("$.watch.run_id"),
                "Statistic": "SampleCount",
                "Period": 60,
                "EvaluationPeriods": minutes,
                "DatapointsToAlarm": minutes,
                "Threshold": 1,
                "ComparisonOperator": "LessThanThreshold",
                # A frozen process emits nothing: no data must count as no progress. A new alarm
                # evaluates its whole range, missing points as breaching
                # (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/alarms-and-missing-data.html),
                # so it is put only once a heartbeat is in that range, or when none came in time.
                "TreatMissingData": "breaching",
            },
            "ResultPath": "$.result",
        })
        self._retry(arm)
        return arm

    # ---- terminate: the job of an alarm that fired, if it still runs ---------------------------
    def _terminate_path(self) -> sfn.IChainable:
        """ReadAlarmContext -> DescribeStalledJob -> StillRunning? -> (last step, terminate, notify)
        | DisarmEndedJobAlarm | NotThisPipelinesJob. The job id comes from the alarm's description,
        which whoever may put an alarm of this name writes, so the job is checked to be this
        pipeline's train job (queue and tags; the role's TerminateJob is tag-scoped as well)."""
        read = self._raw("ReadAlarmContext", {
            "Type": "Pass",
            "Parameters": {"watch.$": "States.StringToJson($.detail.configuration.description)",
                           "alarm_name.$": "$.detail.alarmName"},
        })
        describe = self._describe_job("DescribeStalledJob", "$.watch.job_id")
        still_running = sfn.Choice(self, "StillRunning")
        read.next(describe)
        describe.next(still_running)
        ours = sfn.Condition.and_(sfn.Condition.string_equals("$.job.record.JobQueue", self._queue.job_queue_arn),
                                  self._ownership.owns("$.job.record"))
        foreign = sfn.Fail(self, "NotThisPipelinesJob", error="ForeignJob",
                           cause="The alarm names a Batch job that is not this pipeline's train job (queue, tags); "
                                 "nothing was terminated.")
        still_running.when(sfn.Condition.and_(sfn.Condition.string_equals("$.job.record.Status", "RUNNING"), ours),
                           self._read_last_step(then=self._terminate_and_notify()))
        still_running.when(sfn.Condition.string_equals("$.job.record.Status", "RUNNING"), foreign)
        still_running.otherwise(self._disarm("DisarmEndedJobAlarm", "$.alarm_name"))
        return read

    def _read_last_step(self, *, then: sfn.IChainable) -> sfn.IChainable:
        """ReadLastStep -> SummarizeProgress -> LastStepKnown -> LastStepFromHeartbeat | NoHeartbeatYet
        -> `then`: the last step the heartbeat reported, for the notification."""
        last_step = self._raw("ReadLastStep", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:getMetricData",
            "Parameters": {
                "MetricDataQueries": [self._heartbeat_query("Maximum", 300)],
                "StartTime.$": "$.watch.job_started_at",
                "EndTime.$": "$$.State.EnteredTime",
                "ScanBy": "TimestampDescending",
            },
            "ResultSelector": {"query.$": "States.ArrayGetItem($.MetricDataResults, 0)"},
            "ResultPath": "$.progress",
        })
        summarize = self._raw("SummarizeProgress", {
            "Type": "Pass",
            "Parameters": {"values.$": "$.progress.query.Values",
                           "count.$": "States.ArrayLength($.progress.query.Values)"},
            "ResultPath": "$.progress",
        })
        self._retry(last_step)
        step_known = sfn.Choice(self, "LastStepKnown")
        known = self._raw("LastStepFromHeartbeat", {
            "Type": "Pass", "Parameters": {"text.$": "States.Format('{}', States.ArrayGetItem($.progress.values, 0))"},
            "ResultPath": "$.last_step"})
        unknown = self._raw("NoHeartbeatYet", {
            "Type": "Pass", "Result": {"text": "none (no heartbeat since the job started)"},
            "ResultPath": "$.last_step"})
        last_step.add_catch(unknown, errors=["States.ALL"], result_path="$.progress")
        last_step.next(summarize)
        summarize.next(step_known)
        # Newest first (ScanBy TimestampDescending): the maximum step of the latest 5 minutes.
        step_known.when(sfn.Condition.number_greater_than("$.progress.count", 0), known)
        step_known.otherwise(unknown)
        known.next(then)
        unknown.next(then)
        return last_step

    def _terminate_and_notify(self) -> sfn.IChainable:
        """TerminateStalledJob -> NotifyTerminatedMessage -> NotifyTerminated -> DisarmAfterTerminate."""
        cfg = self._config
        reason = (f"No training progress heartbeat for {cfg.stall_timeout_minutes} minutes, or none within "
                  f"{cfg.first_heartbeat_minutes} minutes of the job starting (stall watchdog)")
        terminate = self._raw("TerminateStalledJob", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:batch:terminateJob",
            "Parameters": {"JobId.$": "$.watch.job_id", "Reason": reason},
            "ResultPath": "$.result",
        })
        self._retry(terminate)
        subject = "Training job terminated: no progress"
        message = compose(self, "NotifyTerminated", title=subject,
                          text=f"States.Format('Run {{}}: terminated Batch job {{}} ({reason}). Last completed step: "
                               f"{{}}. Alarm {{}}.', $.watch.run_id, $.watch.job_id, $.last_step.text, $.alarm_name)")
        notify = publish_state(self, "NotifyTerminated", self._topic.topic_arn, fields={"Subject": subject},
                               result_path="$.result", timeout_seconds=60)
        self._retry(notify)
        disarm = self._disarm("DisarmAfterTerminate", "$.alarm_name")
        # The job is already terminated: a lost notification must not keep the alarm alive.
        notify.add_catch(disarm, errors=["States.ALL"], result_path="$.notify_error")
        terminate.next(message)
        message.next(notify)
        notify.next(disarm)
        return terminate

    # ---- helpers -------------------------------------------------------------------------------
    def _raw(self, name: str, state_json: dict) -> sfn.CustomState:
        return sfn.CustomState(self, name, state_json=state_json)

    def _heartbeat_query(self, stat: str, period: int) -> dict:
        """The run's TrainStep series (JOB_EVENT_RUN_ID_PATH says why the run id matches the job's)."""
        return {"Id": "step", "MetricStat": {
            "Metric": {"Namespace": HEARTBEAT_NAMESPACE, "MetricName": HEARTBEAT_STEP_METRIC,
                       "Dimensions": self._run_dimensions("$.watch.run_id")},
            "Period": period, "Stat": stat}}

    def _run_dimensions(self, run_id_path: str) -> list[dict]:
        return [{"Name": HEARTBEAT_STAGE_DIMENSION, "Value": self._stage},
                {"Name": HEARTBEAT_RUN_DIMENSION, "Value.$": run_id_path}]

    @staticmethod
    def _retry(state: sfn.CustomState) -> None:
        state.add_retry(errors=["States.TaskFailed", "States.Timeout"], interval=Duration.seconds(2), max_attempts=3,
                        backoff_rate=2.0, jitter_strategy=sfn.JitterType.FULL)

    def _describe_job(self, name: str, job_id_path: str) -> sfn.CustomState:
        state = self._raw(name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:batch:describeJobs",
            "Parameters": {"Jobs.$": f"States.Array({job_id_path})"},
            # The whole record: StartedAt is absent while a retry waits, and a missing path in a
            # ResultSelector is a runtime error no Catch sees.
            "ResultSelector": {"record.$": "$.Jobs[0]"},
            "ResultPath": "$.job",
        })
        self._retry(state)
        return state

    def _disarm(self, name: str, alarm_name: str) -> sfn.CustomState:
        key = "AlarmNames.$"
        value = f"States.Array({alarm_name})"
        state = self._raw(name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:deleteAlarms",
            "Parameters": {key: value},
            "ResultPath": "$.result",
        })
        done = sfn.Succeed(self, f"{name}Done")
        state.add_catch(done, errors=["CloudWatch.ResourceNotFoundException"], result_path="$.error")
        state.next(done)
        return state
