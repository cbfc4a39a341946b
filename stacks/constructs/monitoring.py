"""Alerting, stuck-job handling and the dashboard.

- `AlertTopic`: one KMS-encrypted SNS topic every alarm and notification goes to (its own key, so
  the key policy can admit CloudWatch, EventBridge and CloudWatch Logs without touching the
  stateful storage stack).
- `StallWatchdog`: a training job that stops emitting its progress heartbeat is terminated.
  No Lambda: EventBridge + a Standard state machine using SDK integrations (class docstring).
  The per-job alarm watches the heartbeat metric of that run (dimensions Stage + RunId; missing
  data = breaching, so a frozen process that emits nothing fires it) and is put only once the
  job is past PipelineConfig.startup_minutes. RunId: the only run identity the Batch event
  carries is the job's parameters ($.detail.parameters.run_id), and it is exactly what the job
  emits: the job definitions run `--run-dir /fsx/runs/Ref::run_id`, training_image/entrypoint.sh
  exports PIPELINE_RUN_ID = basename of --run-dir, and pipeline_steps/heartbeat.py publishes it
  as the RunId dimension. So a healthy concurrent run of the same stage cannot hide a stalled one.
  The in-process watchdog (pipeline_steps/watchdog.py) covers the common case by exiting with
  the retryable code; this covers a process too frozen to exit.
- `JobEvents`: Batch job state changes of the pipeline's queues go to a log group (per-step
  durations and queue activity on the dashboard); jobs cancelled in RUNNABLE by the queues'
  jobStateTimeLimitActions are reported to the topic.
- `Monitoring`: alarms on the state machines and the dashboard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jsii

from aws_cdk import ArnFormat, Duration, RemovalPolicy, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.constructs.retention import retention_days
from stacks.pipeline_config import PipelineConfig

# Heartbeat contract with pipeline_steps/heartbeat.py (EMF in the train step's logs): namespace,
# metric names and the dimension sets [["Stage"], ["Stage", "RunId"]]. The stall alarm and the
# per-run dashboard graphs use the per-run set. (Duplicated, not imported: the stacks must not
# import the training package.)
HEARTBEAT_NAMESPACE = "TrainiumEmbeddings"
HEARTBEAT_STEP_METRIC = "TrainStep"  # the global step: progress, one datapoint per heartbeat
HEARTBEAT_LOSS_METRIC = "TrainLoss"
HEARTBEAT_THROUGHPUT_METRIC = "TokensPerSecond"
HEARTBEAT_STAGE_DIMENSION = "Stage"
HEARTBEAT_RUN_DIMENSION = "RunId"
HEARTBEAT_RUN_DIMENSIONS = (HEARTBEAT_STAGE_DIMENSION, HEARTBEAT_RUN_DIMENSION)
# Where the Batch "Job State Change" event carries the run id: the job's `run_id` parameter.
JOB_EVENT_RUN_ID_PATH = "$.detail.parameters.run_id"

# jobStateTimeLimitActions reasons (Batch docs use these prefixes; the compute stack sets the text).
RUNNABLE_TIMEOUT_REASON_PREFIXES = ("CAPACITY:", "MISCONFIGURATION:")


class AlertTopic(Construct):
    """KMS key + SNS topic (+ optional e-mail). Public: `key`, `topic`."""

    def __init__(self, scope: Construct, construct_id: str, *, notification_email: str | None) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.key = kms.Key(self, "Key", enable_key_rotation=True,
                           description="Pipeline notifications topic and log groups")
        # CloudWatch alarms and EventBridge rules publish to the encrypted topic as services.
        self.key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:GenerateDataKey*"],
            principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com"), iam.ServicePrincipal("events.amazonaws.com")],
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
    (https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-use-resource-based.html#eb-cloudwatchlogs-permissions).
    """
    logs.ResourcePolicy(scope, f"{rule.node.id}LogsPolicy", policy_statements=[iam.PolicyStatement(
        principals=[iam.ServicePrincipal("events.amazonaws.com"), iam.ServicePrincipal("delivery.logs.amazonaws.com")],
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


class StallWatchdog(Construct):
    """Per-job heartbeat alarms for the Train job definition and termination on ALARM.

    A Standard state machine (it waits: Express workflows end after 5 minutes), one execution per
    event, routed by the event:
      Batch RUNNING (parent job with a run_id) -> WatchRecord -> WaitForStartup (startup_minutes)
        -> DescribeWatchedJob -> StillThisAttempt? -> ArmStallAlarm
        The alarm exists only after the startup bound, so missing data before the first step
        (child nodes pulling the image, rendezvous, first graph load) can never fire it; and if the
        attempt ended or a retry started during the wait, nothing is armed (the retry's own
        RUNNING event arms it).
      CloudWatch ALARM -> ReadAlarmContext -> DescribeStalledJob -> StillRunning?
        -> ReadLastStep -> TerminateStalledJob -> NotifyTerminated -> DisarmAfterTerminate
        (a job that already ended only has its alarm deleted).
      any other Batch status (SUCCEEDED, FAILED, or RUNNABLE/STARTING for a retry) -> DisarmStallAlarm.
    Public: `state_machine`, `alarm_prefix`, `rules`.
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig, stage: str,
                 train_job_definition: batch.IJobDefinition, topic: sns.ITopic, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self._config, self._stage, self._topic = config, stage, topic
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
            state_machine_type=sfn.StateMachineType.STANDARD,
            timeout=Duration.minutes(config.startup_minutes + 60),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            comment="Arms per-job training heartbeat alarms after the startup bound, terminates stalled jobs")
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
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["batch:TerminateJob"],
            resources=[stack.format_arn(service="batch", resource="job", resource_name="*")]))
        topic.grant_publish(role)

        target = targets.SfnStateMachine(self.state_machine, retry_attempts=8)
        self.rules = [
            events.Rule(self, "TrainJobStateRule", targets=[target], event_pattern=events.EventPattern(
                source=["aws.batch"], detail_type=["Batch Job State Change"],
                # RUNNABLE/STARTING: a retry attempt; its alarm goes until its own RUNNING arms it.
                detail={"jobDefinition": [train_job_definition.job_definition_arn],
                        "status": ["RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED"]})),
            events.Rule(self, "StallAlarmRule", targets=[target], event_pattern=events.EventPattern(
                source=["aws.cloudwatch"], detail_type=["CloudWatch Alarm State Change"],
                detail={"alarmName": [{"prefix": f"{self.alarm_prefix}/"}], "state": {"value": ["ALARM"]}})),
        ]

    # ---- arm: after the startup bound, if the same attempt still runs --------------------------
    def _arm_path(self) -> sfn.IChainable:
        minutes = self._config.stall_timeout_minutes
        record = self._raw("WatchRecord", {
            "Type": "Pass",
            # Travels in the alarm's description, so the ALARM event carries everything the
            # terminate path needs (a CloudWatch Alarm State Change event has the description).
            "Parameters": {"run_id.$": JOB_EVENT_RUN_ID_PATH, "job_id.$": "$.detail.jobId",
                           "job_started_at.$": "$.time", "started_at_ms.$": "$.detail.startedAt"},
            "ResultPath": "$.watch",
        })
        wait = sfn.Wait(self, "WaitForStartup",
                        time=sfn.WaitTime.duration(Duration.minutes(self._config.startup_minutes)))
        describe = self._describe_job("DescribeWatchedJob", "$.watch.job_id")
        same_attempt = sfn.Choice(self, "StillThisAttempt")
        arm = self._raw("ArmStallAlarm", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:putMetricAlarm",
            "Parameters": {
                "AlarmName.$": f"States.Format('{self.alarm_prefix}/{{}}', $.watch.job_id)",
                "AlarmDescription.$": "States.JsonToString($.watch)",
                "Namespace": HEARTBEAT_NAMESPACE,
                "MetricName": HEARTBEAT_STEP_METRIC,
                # This run's series only (see the module docstring for why the values match).
                "Dimensions": self._run_dimensions("$.watch.run_id"),
                "Statistic": "SampleCount",
                "Period": 60,
                "EvaluationPeriods": minutes,
                "DatapointsToAlarm": minutes,
                "Threshold": 1,
                "ComparisonOperator": "LessThanThreshold",
                # A frozen process emits nothing: no data must count as no progress. Armed only
                # after the startup bound, a brand-new alarm evaluating its whole range as
                # breaching is what we want: no heartbeat for stall_timeout -> ALARM at once.
                "TreatMissingData": "breaching",
            },
            "ResultPath": "$.result",
        })
        self._retry(arm)
        record.next(wait)
        wait.next(describe)
        describe.next(same_attempt)
        ended = sfn.Succeed(self, "AttemptEndedDuringStartup")
        # Rules are tried in order: only a RUNNING record (which has StartedAt) reaches the second.
        same_attempt.when(sfn.Condition.not_(sfn.Condition.string_equals("$.job.record.Status", "RUNNING")), ended)
        same_attempt.when(sfn.Condition.number_equals_json_path("$.job.record.StartedAt", "$.watch.started_at_ms"), arm)
        same_attempt.otherwise(ended)
        arm.next(sfn.Succeed(self, "Armed"))
        return record

    # ---- terminate: the job of an alarm that fired, if it still runs ---------------------------
    def _terminate_path(self) -> sfn.IChainable:
        cfg = self._config
        read = self._raw("ReadAlarmContext", {
            "Type": "Pass",
            "Parameters": {"watch.$": "States.StringToJson($.detail.configuration.description)",
                           "alarm_name.$": "$.detail.alarmName"},
        })
        describe = self._describe_job("DescribeStalledJob", "$.watch.job_id")
        still_running = sfn.Choice(self, "StillRunning")
        last_step = self._raw("ReadLastStep", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:getMetricData",
            "Parameters": {
                "MetricDataQueries": [{"Id": "step", "MetricStat": {
                    "Metric": {"Namespace": HEARTBEAT_NAMESPACE, "MetricName": HEARTBEAT_STEP_METRIC,
                               "Dimensions": self._run_dimensions("$.watch.run_id")},
                    "Period": 300, "Stat": "Maximum"}}],
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
        reason = (f"No training progress heartbeat for {cfg.stall_timeout_minutes} minutes after the "
                  f"{cfg.startup_minutes}-minute startup bound (stall watchdog)")
        terminate = self._raw("TerminateStalledJob", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:batch:terminateJob",
            "Parameters": {"JobId.$": "$.watch.job_id", "Reason": reason},
            "ResultPath": "$.result",
        })
        self._retry(terminate)
        notify = self._raw("NotifyTerminated", {
            "Type": "Task",
            "Resource": "arn:aws:states:::sns:publish",
            "Parameters": {
                "TopicArn": self._topic.topic_arn,
                "Subject": "Training job terminated: no progress",
                "Message.$": f"States.Format('Run {{}}: terminated Batch job {{}} ({reason}). Last completed step: "
                             f"{{}}. Alarm {{}}.', $.watch.run_id, $.watch.job_id, $.last_step.text, $.alarm_name)",
            },
            "ResultPath": "$.result",
            "TimeoutSeconds": 60,
        })
        self._retry(notify)
        disarm = self._disarm("DisarmAfterTerminate", "$.alarm_name")
        # The job is already terminated: a lost notification must not keep the alarm alive.
        notify.add_catch(disarm, errors=["States.ALL"], result_path="$.notify_error")
        read.next(describe)
        describe.next(still_running)
        still_running.when(sfn.Condition.string_equals("$.job.record.Status", "RUNNING"), last_step)
        still_running.otherwise(self._disarm("DisarmEndedJobAlarm", "$.alarm_name"))
        last_step.next(summarize)
        summarize.next(step_known)
        # Newest first (ScanBy TimestampDescending): the maximum step of the latest 5 minutes.
        step_known.when(sfn.Condition.number_greater_than("$.progress.count", 0), known)
        step_known.otherwise(unknown)
        known.next(terminate)
        unknown.next(terminate)
        terminate.next(notify)
        notify.next(disarm)
        return read

    # ---- helpers -------------------------------------------------------------------------------
    def _raw(self, name: str, state_json: dict) -> sfn.CustomState:
        return sfn.CustomState(self, name, state_json=state_json)

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


class JobEvents(Construct):
    """Batch job state changes of the pipeline queues -> a log group; RUNNABLE cancellations -> topic.

    Public: `log_group`, `runnable_timeout_rule`.
    """

    def __init__(self, scope: Construct, construct_id: str, *, queues: Sequence[batch.IJobQueue],
                 topic: sns.ITopic, key: kms.IKey,
                 runnable_timeout_reason_prefixes: Sequence[str] = RUNNABLE_TIMEOUT_REASON_PREFIXES) -> None:
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
            targets=[targets.SnsTopic(topic, message=events.RuleTargetInput.from_text(
                f"Batch job {events.EventField.from_path('$.detail.jobName')} "
                f"({events.EventField.from_path('$.detail.jobId')}) on queue "
                f"{events.EventField.from_path('$.detail.jobQueue')} was cancelled while waiting for capacity: "
                f"{events.EventField.from_path('$.detail.statusReason')}"))])


class Monitoring(Construct):
    """Alarms (all to the topic) and the dashboard. Public: `alarms`, `dashboard`."""

    def __init__(self, scope: Construct, construct_id: str, *, stage: str, topic: sns.ITopic,
                 pipeline: sfn.StateMachine, helpers: Mapping[str, sfn.StateMachine],
                 rules: Mapping[str, events.IRule], job_log_group: logs.ILogGroup,
                 undelivered_notifications: cw.IMetric, extra_alarms: Sequence[cw.IAlarm] = ()) -> None:
        super().__init__(scope, construct_id)
        action = cw_actions.SnsAction(topic)
        period = Duration.minutes(5)
        self.alarms: list[cw.Alarm] = []

        def alarm(name: str, metric: cw.IMetric, description: str) -> None:
            a = cw.Alarm(self, name, metric=metric, threshold=1, evaluation_periods=1,
                         comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                         treat_missing_data=cw.TreatMissingData.NOT_BREACHING, alarm_description=description)
            a.add_alarm_action(action)
            self.alarms.append(a)

        alarm("PipelineFailed", pipeline.metric_failed(period=period),
              "A training pipeline execution failed (the failure notification has the step and cause).")
        alarm("PipelineTimedOut", pipeline.metric_timed_out(period=period),
              "A training pipeline execution exceeded its overall timeout.")
        alarm("NotificationsUndelivered", undelivered_notifications,
              "A run's outcome notification (published, rejected, superseded) could not be sent after its "
              "retries; the run itself ended normally. See the pipeline execution log.")
        for name, machine in helpers.items():
            alarm(f"{name}Failed", machine.metric_failed(period=period),
                  f"The {name} state machine failed; see its log group.")
        for name, rule in rules.items():
            alarm(f"{name}FailedInvocations",
                  cw.Metric(namespace="AWS/Events", metric_name="FailedInvocations",
                            dimensions_map={"RuleName": rule.rule_name}, statistic="Sum", period=period),
                  f"EventBridge could not deliver events of rule {name} to its target.")

        def search(metric_name: str, stat: str) -> cw.MathExpression:
            # One line per run of this stage (the per-run dimension set).
            return cw.MathExpression(
                expression=f"SEARCH('{{{HEARTBEAT_NAMESPACE},{','.join(HEARTBEAT_RUN_DIMENSIONS)}}} "
                           f"MetricName=\"{metric_name}\" {HEARTBEAT_STAGE_DIMENSION}=\"{stage}\"', '{stat}', 300)",
                using_metrics={}, label=metric_name, period=period)

        self.dashboard = cw.Dashboard(self, "Dashboard", default_interval=Duration.days(7))
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Pipeline executions by status", width=12, left=[
                pipeline.metric_started(period=period, label="started"),
                pipeline.metric_succeeded(period=period, label="succeeded"),
                pipeline.metric_failed(period=period, label="failed"),
                pipeline.metric_timed_out(period=period, label="timed out"),
                pipeline.metric_aborted(period=period, label="aborted")], stacked=True),
            cw.AlarmStatusWidget(title="Alarms (incl. canary)", width=12,
                                 alarms=[*self.alarms, *extra_alarms]),
        )
        self.dashboard.add_widgets(
            cw.LogQueryWidget(
                title="Per-step duration (minutes, Batch job start to stop)", width=12,
                log_group_names=[job_log_group.log_group_name],
                query_lines=[
                    "fields detail.jobName as step, (detail.stoppedAt - detail.startedAt) / 60000 as minutes",
                    "filter detail.status in ['SUCCEEDED', 'FAILED'] and ispresent(detail.startedAt)",
                    "stats avg(minutes) as avg_min, max(minutes) as max_min, count(*) as jobs by step, detail.status",
                ]),
            cw.LogQueryWidget(
                title="Queue activity (job state transitions per hour)", width=12,
                log_group_names=[job_log_group.log_group_name],
                view=cw.LogQueryVisualizationType.STACKEDAREA,
                query_lines=["stats count(*) by detail.status, bin(1h)"]),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Training loss (per run)", width=8, left=[search(HEARTBEAT_LOSS_METRIC, "Average")]),
            cw.GraphWidget(title="Throughput tokens/s (per run)", width=8,
                           left=[search(HEARTBEAT_THROUGHPUT_METRIC, "Average")]),
            cw.GraphWidget(title="Training progress: global step (per run)", width=8,
                           left=[search(HEARTBEAT_STEP_METRIC, "Maximum")]),
        )
