"""Pipeline stack: the training state machine, its trigger, the canary, stall watchdog, alarms, dashboard.

Wiring only; the resource families live in stacks/constructs/{alert_topic, failure_diagnosis,
training_pipeline, triggers, stall_watchdog, job_events, canary, monitoring}.py. Depends on the
storage stack (buckets) and the compute stack (queues, job definitions, job log group); it owns its
own KMS key for the topic and log groups so that no key policy of the stateful stack changes when
this stack does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aws_cdk import CfnOutput, Duration, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from cdk_nag import NagSuppressions
from constructs import Construct

from pipeline_contract import (
    MLFLOW_TRACKING_SERVER_OUTPUT,
    SINGLE_NODE_INSTANCE_TYPE_OUTPUT,
    SINGLE_NODE_QUEUE,
    STATE_MACHINE_OUTPUT,
    TRAINING_INSTANCE_TYPE_OUTPUT,
    TRAINING_QUEUE,
)
from stacks.config import SlackConfig
from stacks.constructs.alert_topic import AlertTopic
from stacks.constructs.canary import Canary
from stacks.constructs.failure_diagnosis import FailureDiagnosis
from stacks.constructs.job_definitions import JobDefinitionRef, TeamJobs
from stacks.constructs.job_events import JobEvents
from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.monitoring import Monitoring
from stacks.constructs.queue_wait import QueueWaitLimit
from stacks.constructs.slack_channel import SlackChannel
from stacks.constructs.stall_watchdog import StallWatchdog
from stacks.constructs.team_access import admin_role, team_role
from stacks.constructs.training_pipeline import GATE_KEY_PATTERN, TrainingPipeline
from stacks.constructs.triggers import RunTrigger
from stacks.pipeline_config import PipelineConfig


@dataclass(frozen=True)
class TeamPipeline:
    """One team's state machine, trigger and job tags. `prefix`: its construct ids' and outputs'
    ("" for the default team of a stage without teams)."""

    prefix: str
    pipeline: TrainingPipeline
    trigger: RunTrigger
    ownership: JobOwnership
    jobs: TeamJobs


class PipelineStack(Stack):
    """Public: topic, slack (SlackChannel or None), ownership (the tags of this pipeline's Batch
    jobs), diagnosis (FailureDiagnosis), pipelines (team name, or None for the default team ->
    TeamPipeline), pipeline and trigger (the first team's), canary (or None), watchdog, queue_wait, monitoring, team_roles (team name -> role)
    and admin_role (None without teams)."""

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig, stage: str,
                 data_bucket: s3.IBucket, artifacts_bucket: s3.IBucket,
                 queues: Mapping[str, batch.IJobQueue], teams: Sequence[TeamJobs],
                 canary_job_definition: JobDefinitionRef, instance_types: Mapping[str, str], max_nodes: int,
                 queue_wait: Duration, admin_principals: Sequence[str] = (), storage_stack_name: str | None = None,
                 mlflow_tracking_server_arn: str | None = None, diagnosis_asset_hash: str | None = None,
                 slack: SlackConfig | None = None, **kwargs: Any) -> None:
        """`teams`: each team's job definitions, job log group and role (one entry, team None, for
        a stage without teams); `instance_types`: "training" / "single-node" -> EC2 instance type of
        the queues' compute environments; `max_nodes`: the training compute environment's largest
        job (input check); `queue_wait`: the queues' RUNNABLE time limit (part of every Batch state's
        timeout); `admin_principals`, `storage_stack_name`: the admin role's trust and what the
        teams' roles may describe; with `mlflow_tracking_server_arn`, outputs for the operator CLI
        (pipeline_ops); `diagnosis_asset_hash` fixes the classifier code's asset hash (tests); with
        `slack`, the notifications also go to that Slack channel (AWS Chatbot)."""
        super().__init__(scope, construct_id, **kwargs)
        alerts = AlertTopic(self, "Alerts", notification_email=config.notification_email)
        self.topic = alerts.topic
        self.slack = slack and SlackChannel(self, "Slack", workspace_id=slack.workspace_id, channel_id=slack.channel_id,
                                            topic=alerts.topic, key=alerts.key,
                                            log_retention_days=config.log_retention_days)
        chat_topic = self.slack.chat_topic if self.slack else None
        self.ownership = JobOwnership.of(self)
        self.diagnosis = FailureDiagnosis(self, "FailureDiagnosis", stage=stage,
                                          job_log_groups=[t.log_group for t in teams],
                                          key=alerts.key, log_retention_days=config.log_retention_days,
                                          asset_hash=diagnosis_asset_hash)
        self.pipelines = {t.team.name if t.team else None: self._team_pipeline(
            t, config=config, data_bucket=data_bucket, artifacts_bucket=artifacts_bucket, queues=queues,
            max_nodes=max_nodes, queue_wait=queue_wait, alerts=alerts) for t in teams}
        first = next(iter(self.pipelines.values()))
        self.pipeline, self.trigger = first.pipeline, first.trigger
        self.watchdog = StallWatchdog(self, "StallWatchdog", config=config, stage=stage,
                                      train_job_definitions=[t.refs["train"] for t in teams],
                                      training_queue=queues[TRAINING_QUEUE], ownership=self.ownership, topic=alerts.topic,
                                      key=alerts.key)
        job_events = JobEvents(self, "JobEvents", queues=list(queues.values()), topic=alerts.topic, key=alerts.key,
                               chat_topic=chat_topic)
        self.queue_wait = QueueWaitLimit(self, "QueueWait", queues=list(queues.values()), queue_wait=queue_wait,
                                         ownership=self.ownership, key=alerts.key)
        self.canary = None
        if config.canary_interval_minutes is not None:
            self.canary = Canary(self, "Canary", config=config, queue=queues[SINGLE_NODE_QUEUE],
                                 job_definition=canary_job_definition, topic=alerts.topic, key=alerts.key,
                                 ownership=self.ownership, chat_topic=chat_topic)
        self._monitoring(stage, alerts, job_events)
        self.team_roles, self.admin_role = self._access(teams, data_bucket, artifacts_bucket, admin_principals,
                                                        [self.stack_name, storage_stack_name or self.stack_name])
        self._outputs(queues, instance_types, mlflow_tracking_server_arn)
        self._acknowledge()

    def _team_pipeline(self, jobs: TeamJobs, *, config: PipelineConfig, data_bucket: s3.IBucket,
                       artifacts_bucket: s3.IBucket, queues: Mapping[str, batch.IJobQueue], max_nodes: int,
                       queue_wait: Duration, alerts: AlertTopic) -> TeamPipeline:
        """A team's state machine and new-data trigger (the default team keeps the construct ids a
        stage without teams always had)."""
        team = jobs.team
        prefix = team.construct_name if team else ""
        ownership = JobOwnership.of(self, team.name if team else None)
        pipeline = TrainingPipeline(
            self, f"{prefix}TrainingPipeline", config=config, artifacts_bucket=artifacts_bucket,
            data_bucket=data_bucket, queues=queues, job_definitions=jobs.refs, topic=alerts.topic, key=alerts.key,
            classifier=self.diagnosis.function, max_nodes=max_nodes, queue_wait=queue_wait, ownership=ownership,
            team=team)
        trigger_config = replace(config, incoming_prefix=team.paths.incoming_prefix) if team else config
        trigger = RunTrigger(self, f"{prefix}Trigger", config=trigger_config, data_bucket=data_bucket,
                             pipeline=pipeline.state_machine, key=alerts.key)
        return TeamPipeline(prefix=prefix, pipeline=pipeline, trigger=trigger, ownership=ownership, jobs=jobs)

    def _monitoring(self, stage: str, alerts: AlertTopic, job_events: JobEvents) -> None:
        pipelines = list(self.pipelines.values())
        self.monitoring = Monitoring(
            self, "Monitoring", stage=stage, topic=alerts.topic,
            pipelines={p.prefix: p.pipeline.state_machine for p in pipelines},
            helpers={**{f"{p.prefix}Starter": p.trigger.starter for p in pipelines},
                     "StallWatchdog": self.watchdog.state_machine, "QueueWait": self.queue_wait.state_machine},
            rules={**{f"{p.prefix}NewData": p.trigger.rule for p in pipelines}, "TrainJobState": self.watchdog.rules[0],
                   "StallAlarm": self.watchdog.rules[1], "Runnable": self.queue_wait.rule},
            job_log_group=job_events.log_group,
            undelivered_notifications={p.prefix: p.pipeline.undelivered_metric for p in pipelines},
            classifier=self.diagnosis.function, failures_by_class=self.diagnosis.failures_by_class,
            extra_alarms=[self.canary.alarm] if self.canary else [])

    def _access(self, teams: Sequence[TeamJobs], data_bucket: s3.IBucket, artifacts_bucket: s3.IBucket,
                admin_principals: Sequence[str], stack_names: Sequence[str]) -> tuple[dict[str, iam.Role], iam.Role | None]:
        """Each team's role and the platform admin role (a stage with teams only)."""
        named = [(p, p.jobs.team) for p in self.pipelines.values() if p.jobs.team is not None]
        roles = {team.name: team_role(
            self, f"{p.prefix}Role", team=team, state_machine=p.pipeline.state_machine,
            data_bucket=data_bucket, artifacts_bucket=artifacts_bucket, log_group=p.jobs.log_group,
            ownership=p.ownership, stack_names=stack_names) for p, team in named}
        if not named:
            return roles, None
        return roles, admin_role(self, "AdminRole", principals=admin_principals,
                                 state_machines=[p.pipeline.state_machine for p, _ in named], data_bucket=data_bucket,
                                 artifacts_bucket=artifacts_bucket, log_groups=[p.jobs.log_group for p, _ in named],
                                 ownership=self.ownership, stack_names=stack_names)

    def _outputs(self, queues: Mapping[str, batch.IJobQueue], instance_types: Mapping[str, str],
                 mlflow_tracking_server_arn: str | None) -> None:
        # trainium-runs finds a team's pipeline by `<Team>StateMachineArn` (pipeline_ops/context.py).
        for p in self.pipelines.values():
            CfnOutput(self, f"{p.prefix}{STATE_MACHINE_OUTPUT}", value=p.pipeline.state_machine.state_machine_arn)
        for name, role in self.team_roles.items():
            CfnOutput(self, f"{name.capitalize()}RoleArn", value=role.role_arn,
                      description=f"Team {name}'s principals assume this role (trainium-runs --team {name})")
        if self.admin_role is not None:
            CfnOutput(self, "AdminRoleArn", value=self.admin_role.role_arn,
                      description="The platform admin role: every team's runs, jobs and artifacts")
        CfnOutput(self, "TopicArn", value=self.topic.topic_arn)
        CfnOutput(self, "TrainingQueueArn", value=queues[TRAINING_QUEUE].job_queue_arn,
                  description="The fair-share training queue (production and experiments share identifiers)")
        CfnOutput(self, "DashboardName", value=self.monitoring.dashboard.dashboard_name)
        # trainium-runs prices each Batch job by these (pipeline_ops/context.py Context.instance_types).
        CfnOutput(self, TRAINING_INSTANCE_TYPE_OUTPUT, value=instance_types[TRAINING_QUEUE])
        CfnOutput(self, SINGLE_NODE_INSTANCE_TYPE_OUTPUT, value=instance_types[SINGLE_NODE_QUEUE])
        if mlflow_tracking_server_arn is not None:
            CfnOutput(self, MLFLOW_TRACKING_SERVER_OUTPUT, value=mlflow_tracking_server_arn,
                      description="MLFLOW_TRACKING_URI of the pipeline's jobs (SageMaker managed MLflow)")

    def _acknowledge(self) -> None:
        NagSuppressions.add_stack_suppressions(self, [
            {"id": "AwsSolutions-IAM5", "reason": (
                "Wildcards are runtime-only ids: batch:DescribeJobs, batch:ListJobs and cloudwatch:GetMetricData "
                "have no resource-level permissions; the classifier reads log streams of the job log group "
                "(<group>:*, streams are named at run time); "
                "batch:TerminateJob/CancelJob target job/* with the pipeline's (and a team's) tag as condition "
                "(job ids exist only at run time); a team's role reads, uploads and deletes objects below its own "
                "prefixes only (keys are arbitrary; listing is conditioned on the same prefixes), and it and the admin "
                "role describe and stop executions of their state machines (<machine>:*, ids exist only at run "
                "time); job definitions are "
                "granted by name for any revision (<name>:*: jobs are submitted by name, and Batch authorises the "
                "revision it resolves); gate.json keys are "
                f"{GATE_KEY_PATTERN} (run id = execution name; a team's below runs/<team>/); per-job stall alarms are "
                "<stack>-TrainStalled/*; X-Ray and log-delivery actions are '*' by API design; KMS "
                "GenerateDataKey*/ReEncrypt* come from grant_* on the pipeline and bucket keys.")},
        ])
