"""Alerting, stuck-job handling and the dashboard.

- `AlertTopic`: one KMS-encrypted SNS topic every alarm and notification goes to (its own key, so
  the key policy can admit CloudWatch, EventBridge and CloudWatch Logs without touching the
  stateful storage stack).
- `StallWatchdog`: a training job that stops emitting its progress heartbeat is terminated.
  No Lambda: EventBridge + a small Express state machine using SDK integrations.
    Batch "Job State Change" RUNNING (train job definition) -> put a per-job alarm on the
      heartbeat metric of that run (dimensions Stage + RunId; missing data = breaching, so a frozen
      process that emits nothing fires it). Arming at RUNNING keeps queue wait out of the stall clock.
      RunId: the only run identity the event carries is the job's Batch parameters
      ($.detail.parameters.run_id), and it is exactly what the job emits: the job definitions run
      `--run-dir /fsx/runs/Ref::run_id`, training_image/entrypoint.sh exports PIPELINE_RUN_ID =
      basename of --run-dir, and pipeline_steps/heartbeat.py publishes it as the RunId dimension.
      So a healthy concurrent run of the same stage cannot hide a stalled one.
    alarm -> ALARM ("CloudWatch Alarm State Change") -> batch:TerminateJob + notify.
    job SUCCEEDED/FAILED -> delete the per-job alarm.
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

    Public: `state_machine`, `alarm_prefix`, `rules`.
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig, stage: str,
                 train_job_definition: batch.IJobDefinition, topic: sns.ITopic, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        minutes = config.stall_timeout_minutes
        # '/' separates the job id: alarm names allow it, job ids and stack names never contain it.
        self.alarm_prefix = f"{stack.stack_name}-TrainStalled"

        done = sfn.Succeed(self, "Done")
        arm = sfn.CustomState(self, "ArmStallAlarm", state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:putMetricAlarm",
            "Parameters": {
                "AlarmName.$": f"States.Format('{self.alarm_prefix}/{{}}', $.detail.jobId)",
                "AlarmDescription.$": (
                    f"States.Format('No training progress ({HEARTBEAT_STEP_METRIC}) for {minutes} minutes from "
                    f"Batch job {{}} of run {{}}; the watchdog terminates the job.', $.detail.jobId, {JOB_EVENT_RUN_ID_PATH})"
                ),
                "Namespace": HEARTBEAT_NAMESPACE,
                "MetricName": HEARTBEAT_STEP_METRIC,
                # This run's series only (see the module docstring for why the values match).
                "Dimensions": [
                    {"Name": HEARTBEAT_STAGE_DIMENSION, "Value": stage},
                    {"Name": HEARTBEAT_RUN_DIMENSION, "Value.$": JOB_EVENT_RUN_ID_PATH},
                ],
                "Statistic": "SampleCount",
                "Period": 60,
                "EvaluationPeriods": minutes,
                "DatapointsToAlarm": minutes,
                "Threshold": 1,
                "ComparisonOperator": "LessThanThreshold",
                # A frozen process emits nothing: no data must count as no progress.
                "TreatMissingData": "breaching",
                "AlarmActions": [topic.topic_arn],
            },
            "ResultPath": "$.result",
        })
        disarm = sfn.CustomState(self, "DisarmStallAlarm", state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:cloudwatch:deleteAlarms",
            "Parameters": {"AlarmNames.$": f"States.Array(States.Format('{self.alarm_prefix}/{{}}', $.detail.jobId))"},
            "ResultPath": "$.result",
        })
        terminate = sfn.CustomState(self, "TerminateStalledJob", state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:batch:terminateJob",
            "Parameters": {
                "JobId.$": "States.ArrayGetItem(States.StringSplit($.detail.alarmName, '/'), 1)",
                "Reason": f"No training progress heartbeat for {minutes} minutes (stall watchdog)",
            },
            "ResultPath": "$.result",
        })
        notify = sfn.CustomState(self, "NotifyTerminated", state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::sns:publish",
            "Parameters": {
                "TopicArn": topic.topic_arn,
                "Subject": "Training job terminated: no progress",
                "Message.$": "States.Format('Terminated Batch job {} after alarm {}: {}', "
                             "States.ArrayGetItem(States.StringSplit($.detail.alarmName, '/'), 1), "
                             "$.detail.alarmName, $.detail.state.reason)",
            },
            "ResultPath": "$.result",
        })
        retry = {"errors": ["States.TaskFailed"], "interval": Duration.seconds(2), "max_attempts": 3,
                 "backoff_rate": 2.0, "jitter_strategy": sfn.JitterType.FULL}
        for state in (arm, terminate, notify):
            state.add_retry(**retry)
        arm.next(done)
        terminate.next(notify)
        notify.next(done)
        disarm.add_catch(done, errors=["CloudWatch.ResourceNotFoundException"], result_path="$.error")
        disarm.next(done)

        route = sfn.Choice(self, "Route")
        # Multi-node jobs also emit one event per node (with nodeDetails); watch the parent only.
        route.when(sfn.Condition.is_present("$.detail.nodeDetails"), sfn.Succeed(self, "IgnoreNodeEvent"))
        route.when(sfn.Condition.string_equals("$.source", "aws.cloudwatch"), terminate)
        # A train job without a run_id parameter cannot start (the entrypoint refuses the literal
        # Ref::run_id with exit 78), so there is no run to watch.
        route.when(sfn.Condition.and_(sfn.Condition.string_equals("$.detail.status", "RUNNING"),
                                      sfn.Condition.is_present(JOB_EVENT_RUN_ID_PATH)), arm)
        route.when(sfn.Condition.string_equals("$.detail.status", "RUNNING"), sfn.Succeed(self, "NoRunIdToWatch"))
        route.otherwise(disarm)

        self.state_machine = express_state_machine(
            self, "StateMachine", definition=route, log_group=encrypted_log_group(self, "Logs", key),
            comment="Arms/disarms per-job training heartbeat alarms and terminates stalled jobs")
        role = self.state_machine.role
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["cloudwatch:PutMetricAlarm", "cloudwatch:DeleteAlarms"],
            resources=[stack.format_arn(service="cloudwatch", resource="alarm",
                                        resource_name=f"{self.alarm_prefix}/*", arn_format=ArnFormat.COLON_RESOURCE_NAME)]))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["batch:TerminateJob"],
            resources=[stack.format_arn(service="batch", resource="job", resource_name="*")]))
        topic.grant_publish(role)

        target = targets.SfnStateMachine(self.state_machine, retry_attempts=8)
        self.rules = [
            events.Rule(self, "TrainJobStateRule", targets=[target], event_pattern=events.EventPattern(
                source=["aws.batch"], detail_type=["Batch Job State Change"],
                detail={"jobDefinition": [train_job_definition.job_definition_arn],
                        "status": ["RUNNING", "SUCCEEDED", "FAILED"]})),
            events.Rule(self, "StallAlarmRule", targets=[target], event_pattern=events.EventPattern(
                source=["aws.cloudwatch"], detail_type=["CloudWatch Alarm State Change"],
                detail={"alarmName": [{"prefix": f"{self.alarm_prefix}/"}], "state": {"value": ["ALARM"]}})),
        ]


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
                 extra_alarms: Sequence[cw.IAlarm] = ()) -> None:
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
