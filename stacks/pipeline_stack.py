"""Pipeline stack: the training state machine, its trigger, the canary, stall watchdog, alarms, dashboard.

Wiring only; the resource families live in stacks/constructs/{alert_topic, failure_diagnosis,
training_pipeline, triggers, stall_watchdog, job_events, canary, monitoring}.py. Depends on the
storage stack (buckets) and the compute stack (queues, job definitions, job log group); it owns its
own KMS key for the topic and log groups so that no key policy of the stateful stack changes when
this stack does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_cdk import CfnOutput, Duration, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from cdk_nag import NagSuppressions
from constructs import Construct

from stacks.constructs.alert_topic import AlertTopic
from stacks.constructs.canary import Canary
from stacks.constructs.failure_diagnosis import FailureDiagnosis
from stacks.constructs.job_definitions import JobDefinitionRef
from stacks.constructs.job_events import JobEvents
from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.monitoring import Monitoring
from stacks.constructs.queue_wait import QueueWaitLimit
from stacks.constructs.stall_watchdog import StallWatchdog
from stacks.constructs.training_pipeline import GATE_KEY_PATTERN, TrainingPipeline
from stacks.constructs.triggers import RunTrigger
from stacks.pipeline_config import PipelineConfig


class PipelineStack(Stack):
    """Public: topic, ownership (the tags of this pipeline's Batch jobs), diagnosis (FailureDiagnosis),
    pipeline (TrainingPipeline), trigger, canary (or None), watchdog, queue_wait, monitoring."""

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig, stage: str,
                 data_bucket: s3.IBucket, artifacts_bucket: s3.IBucket,
                 queues: Mapping[str, batch.IJobQueue], job_definitions: Mapping[str, JobDefinitionRef],
                 job_log_group: logs.ILogGroup, instance_types: Mapping[str, str], max_nodes: int,
                 queue_wait: Duration, mlflow_tracking_server_arn: str | None = None,
                 diagnosis_asset_hash: str | None = None, **kwargs: Any) -> None:
        """`job_log_group`: where the Batch jobs log (the failure classifier reads it);
        `instance_types`: "training" / "single-node" -> EC2 instance type of the queues' compute
        environments; `max_nodes`: the training compute environment's largest job (input check);
        `queue_wait`: the queues' RUNNABLE time limit (part of every Batch state's timeout); with
        `mlflow_tracking_server_arn`, outputs for the operator CLI (pipeline_ops);
        `diagnosis_asset_hash` fixes the classifier code's asset hash (tests)."""
        super().__init__(scope, construct_id, **kwargs)
        alerts = AlertTopic(self, "Alerts", notification_email=config.notification_email)
        self.topic = alerts.topic
        self.ownership = JobOwnership.of(self)
        self.diagnosis = FailureDiagnosis(self, "FailureDiagnosis", stage=stage, job_log_group=job_log_group,
                                          key=alerts.key, log_retention_days=config.log_retention_days,
                                          asset_hash=diagnosis_asset_hash)
        self.pipeline = TrainingPipeline(
            self, "TrainingPipeline", config=config, artifacts_bucket=artifacts_bucket, data_bucket=data_bucket,
            queues=queues, job_definitions=job_definitions, topic=alerts.topic, key=alerts.key,
            classifier=self.diagnosis.function, max_nodes=max_nodes, queue_wait=queue_wait,
            ownership=self.ownership)
        self.trigger = RunTrigger(self, "Trigger", config=config, data_bucket=data_bucket,
                                  pipeline=self.pipeline.state_machine, key=alerts.key)
        self.watchdog = StallWatchdog(self, "StallWatchdog", config=config, stage=stage,
                                      train_job_definition=job_definitions["train"], training_queue=queues["training"],
                                      ownership=self.ownership, topic=alerts.topic, key=alerts.key)
        job_events = JobEvents(self, "JobEvents", queues=list(queues.values()), topic=alerts.topic, key=alerts.key)
        self.queue_wait = QueueWaitLimit(self, "QueueWait", queues=list(queues.values()), queue_wait=queue_wait,
                                         ownership=self.ownership, key=alerts.key)
        self.canary = None
        if config.canary_interval_minutes is not None:
            self.canary = Canary(self, "Canary", config=config, queue=queues["single-node"],
                                 job_definition=job_definitions["canary"], topic=alerts.topic, key=alerts.key,
                                 ownership=self.ownership)
        self.monitoring = Monitoring(
            self, "Monitoring", stage=stage, topic=alerts.topic, pipeline=self.pipeline.state_machine,
            helpers={"Starter": self.trigger.starter, "StallWatchdog": self.watchdog.state_machine,
                     "QueueWait": self.queue_wait.state_machine},
            rules={"NewData": self.trigger.rule, "TrainJobState": self.watchdog.rules[0],
                   "StallAlarm": self.watchdog.rules[1], "Runnable": self.queue_wait.rule},
            job_log_group=job_events.log_group, undelivered_notifications=self.pipeline.undelivered_metric,
            classifier=self.diagnosis.function, failures_by_class=self.diagnosis.failures_by_class,
            extra_alarms=[self.canary.alarm] if self.canary else [])

        CfnOutput(self, "StateMachineArn", value=self.pipeline.state_machine.state_machine_arn)
        CfnOutput(self, "TopicArn", value=self.topic.topic_arn)
        CfnOutput(self, "TrainingQueueArn", value=queues["training"].job_queue_arn,
                  description="The fair-share training queue (production and experiments share identifiers)")
        CfnOutput(self, "DashboardName", value=self.monitoring.dashboard.dashboard_name)
        # trainium-runs prices each Batch job by these (pipeline_ops/cli.py Context.instance_types).
        CfnOutput(self, "TrainingInstanceType", value=instance_types["training"])
        CfnOutput(self, "SingleNodeInstanceType", value=instance_types["single-node"])
        if mlflow_tracking_server_arn is not None:
            CfnOutput(self, "MlflowTrackingServerArn", value=mlflow_tracking_server_arn,
                      description="MLFLOW_TRACKING_URI of the pipeline's jobs (SageMaker managed MLflow)")
        self._acknowledge()

    def _acknowledge(self) -> None:
        NagSuppressions.add_stack_suppressions(self, [
            {"id": "AwsSolutions-IAM5", "reason": (
                "Wildcards are runtime-only ids: batch:DescribeJobs, batch:ListJobs and cloudwatch:GetMetricData "
                "have no resource-level permissions; the classifier reads log streams of the job log group "
                "(<group>:*, streams are named at run time); "
                "batch:TerminateJob/CancelJob target job/* with the pipeline's tag as condition (job ids exist "
                "only at run time); job definitions are "
                "granted by name for any revision (<name>:*: jobs are submitted by name, and Batch authorises the "
                "revision it resolves); gate.json keys are "
                f"{GATE_KEY_PATTERN} (run id = execution name); per-job stall alarms are "
                "<stack>-TrainStalled/*; X-Ray and log-delivery actions are '*' by API design; KMS "
                "GenerateDataKey*/ReEncrypt* come from grant_* on the pipeline and bucket keys.")},
        ])
