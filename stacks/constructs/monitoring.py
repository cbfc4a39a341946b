"""Alarms on the pipeline's state machines and rules (all to the alert topic) and the dashboard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from pipeline_steps.contract import (
    HEARTBEAT_LOSS_METRIC,
    HEARTBEAT_NAMESPACE,
    HEARTBEAT_RUN_DIMENSION,
    HEARTBEAT_STAGE_DIMENSION,
    HEARTBEAT_STEP_METRIC,
    HEARTBEAT_THROUGHPUT_METRIC,
)


class Monitoring(Construct):
    """Alarms (all to the topic) and the dashboard. Public: `alarms`, `dashboard`."""

    def __init__(self, scope: Construct, construct_id: str, *, stage: str, topic: sns.ITopic,
                 pipelines: Mapping[str, sfn.StateMachine], helpers: Mapping[str, sfn.StateMachine],
                 rules: Mapping[str, events.IRule], job_log_group: logs.ILogGroup,
                 undelivered_notifications: Mapping[str, cw.IMetric], classifier: lambda_.IFunction,
                 failures_by_class: cw.IMetric, extra_alarms: Sequence[cw.IAlarm] = ()) -> None:
        """`pipelines` and `undelivered_notifications`: per team, keyed by the prefix of its alarms
        ("" for the default team, else the team's construct name); `classifier`: the failure path's
        classifier function (alarm on its errors); `failures_by_class`: its per-class metric (dashboard)."""
        super().__init__(scope, construct_id)
        period = Duration.minutes(5)
        self._action = cw_actions.SnsAction(topic)
        self.alarms: list[cw.Alarm] = []
        for prefix, pipeline in pipelines.items():
            self._alarm_on_pipeline(prefix, pipeline, undelivered_notifications[prefix], period)
        self._alarm_on_helpers(helpers=helpers, rules=rules, period=period)
        self._alarm("FailureClassifierErrors", classifier.metric_errors(period=period),
                    "The failure classifier function failed: failure notifications carry the raw error and "
                    "cause only (class 'unclassified'). See the function's log group.")
        self.dashboard = self._dashboard(stage=stage, pipelines=pipelines, job_log_group=job_log_group,
                                         extra_alarms=extra_alarms, period=period)
        self.dashboard.add_widgets(cw.GraphWidget(
            title="Failed runs by class (docs/operations.md, Why a run failed)", width=24,
            left=[failures_by_class], stacked=True, period=Duration.hours(1)))

    def _alarm(self, name: str, metric: cw.IMetric, description: str) -> None:
        a = cw.Alarm(self, name, metric=metric, threshold=1, evaluation_periods=1,
                     comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                     treat_missing_data=cw.TreatMissingData.NOT_BREACHING, alarm_description=description)
        a.add_alarm_action(self._action)
        self.alarms.append(a)

    def _alarm_on_pipeline(self, prefix: str, pipeline: sfn.StateMachine, undelivered: cw.IMetric,
                           period: Duration) -> None:
        """A team's pipeline failed or timed out, or one of its notifications went undelivered."""
        whose = f"{prefix} " if prefix else ""
        self._alarm(f"{prefix}PipelineFailed", pipeline.metric_failed(period=period),
                    f"A {whose}training pipeline execution failed (the failure notification has the step and cause).")
        self._alarm(f"{prefix}PipelineTimedOut", pipeline.metric_timed_out(period=period),
                    f"A {whose}training pipeline execution exceeded its overall timeout.")
        self._alarm(f"{prefix}NotificationsUndelivered", undelivered,
                    "A run's outcome notification (published, rejected, superseded) could not be sent after its "
                    "retries; the run itself ended normally. See the pipeline execution log.")

    def _alarm_on_helpers(self, *, helpers: Mapping[str, sfn.StateMachine], rules: Mapping[str, events.IRule],
                          period: Duration) -> None:
        """A helper state machine failed, an EventBridge rule could not deliver."""
        for name, machine in helpers.items():
            self._alarm(f"{name}Failed", machine.metric_failed(period=period),
                        f"The {name} state machine failed; see its log group.")
        for name, rule in rules.items():
            self._alarm(f"{name}FailedInvocations",
                        cw.Metric(namespace="AWS/Events", metric_name="FailedInvocations",
                                  dimensions_map={"RuleName": rule.rule_name}, statistic="Sum", period=period),
                        f"EventBridge could not deliver events of rule {name} to its target.")

    def _dashboard(self, *, stage: str, pipelines: Mapping[str, sfn.StateMachine], job_log_group: logs.ILogGroup,
                   extra_alarms: Sequence[cw.IAlarm], period: Duration) -> cw.Dashboard:
        """Executions and alarms; per-step durations and queue activity (job state logs); the
        per-run training heartbeat (loss, throughput, global step)."""

        def search(metric_name: str, stat: str) -> cw.MathExpression:
            # One line per run of this stage (the per-run dimension set).
            return cw.MathExpression(
                expression=f"SEARCH('{{{HEARTBEAT_NAMESPACE},{HEARTBEAT_STAGE_DIMENSION},{HEARTBEAT_RUN_DIMENSION}}} "
                           f"MetricName=\"{metric_name}\" {HEARTBEAT_STAGE_DIMENSION}=\"{stage}\"', '{stat}', 300)",
                using_metrics={}, label=metric_name, period=period)

        dashboard = cw.Dashboard(self, "Dashboard", default_interval=Duration.days(7))
        dashboard.add_widgets(
            cw.GraphWidget(title="Pipeline executions by status", width=12, left=[
                metric(period=period, label=f"{prefix} {label}".strip())
                for prefix, pipeline in pipelines.items()
                for label, metric in (("started", pipeline.metric_started), ("succeeded", pipeline.metric_succeeded),
                                      ("failed", pipeline.metric_failed), ("timed out", pipeline.metric_timed_out),
                                      ("aborted", pipeline.metric_aborted))], stacked=True),
            cw.AlarmStatusWidget(title="Alarms (incl. canary)", width=12,
                                 alarms=[*self.alarms, *extra_alarms]),
        )
        dashboard.add_widgets(
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
        dashboard.add_widgets(
            cw.GraphWidget(title="Training loss (per run)", width=8, left=[search(HEARTBEAT_LOSS_METRIC, "Average")]),
            cw.GraphWidget(title="Throughput tokens/s (per run)", width=8,
                           left=[search(HEARTBEAT_THROUGHPUT_METRIC, "Average")]),
            cw.GraphWidget(title="Training progress: global step (per run)", width=8,
                           left=[search(HEARTBEAT_STEP_METRIC, "Maximum")]),
        )
        return dashboard
