"""The synthesized pipeline and starter state machines deployed into moto: the mocked resources
standing in for the stacks' (buckets, topic, queues, job definitions), with the Batch integration
patch of moto_batch.py. Shared by the orchestration tests (test_pipeline_execution.py) and the
operator CLI's tests (tests/ops)."""

from __future__ import annotations

import json
import time

import boto3
from moto.sns import sns_backends

from tests.infra.pipeline_fixtures import ENV, JOB_DEFINITIONS, synthesized

REGION = ENV.region
ARTIFACTS = "artifacts-bucket"
DATA = "data-bucket"
ROLE = f"arn:aws:iam::{ENV.account}:role/sfn"
# Uploads the data bucket holds in every test (the runs' data_uri must exist).
UPLOADS = ("catalog/v1", "catalog/v2", "catalog/v3")


class PipelineWorld:
    """Mocked resources standing in for the stand-in stack's, and the deployed state machines."""

    def __init__(self, hooks) -> None:
        self.hooks = hooks
        self.sfn = boto3.client("stepfunctions", region_name=REGION)
        self.s3 = boto3.client("s3", region_name=REGION)
        self.batch = boto3.client("batch", region_name=REGION)
        sns = boto3.client("sns", region_name=REGION)
        sqs = boto3.client("sqs", region_name=REGION)
        syn = synthesized()
        deps = syn.deps
        values: dict[str, str] = {}
        for bucket, construct in ((ARTIFACTS, deps.artifacts_bucket), (DATA, deps.data_bucket)):
            self.s3.create_bucket(Bucket=bucket)
            lid = syn.logical_id(construct)
            values[lid], values[f"{lid}.Arn"] = bucket, f"arn:aws:s3:::{bucket}"
        for upload in UPLOADS:
            self.s3.put_object(Bucket=DATA, Key=f"incoming/{upload}/pairs/part-0.jsonl", Body=b"{}")
            self.s3.put_object(Bucket=DATA, Key=f"incoming/{upload}/_SUCCESS", Body=b"")
        boto3.client("iam", region_name=REGION).create_role(RoleName="batch", AssumeRolePolicyDocument="{}")
        ce = self.batch.create_compute_environment(computeEnvironmentName="pipeline-ce", type="UNMANAGED",
            serviceRole=f"arn:aws:iam::{ENV.account}:role/batch")["computeEnvironmentArn"]
        for name, queue in deps.queues.items():
            arn = self.batch.create_job_queue(jobQueueName=name, state="ENABLED", priority=1,
                                              computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}])["jobQueueArn"]
            lid = syn.logical_id(queue)
            values[lid] = values[f"{lid}.JobQueueArn"] = arn
        for name in JOB_DEFINITIONS:
            self.batch.register_job_definition(
                jobDefinitionName=deps.job_definitions[name].name, type="container",
                containerProperties={"image": "busybox", "vcpus": 1, "memory": 128, "command": ["true"]})
        values[f"{syn.logical_id(syn.stack.diagnosis.function)}.Arn"] = \
            f"arn:aws:lambda:{REGION}:{ENV.account}:function:classifier"  # runs in-process (moto_batch.py)
        self.topic_arn = sns.create_topic(Name="alerts")["TopicArn"]
        values[syn.logical_id(syn.stack.topic)] = self.topic_arn
        queue_url = sqs.create_queue(QueueName="inbox")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=self.topic_arn, Protocol="sqs", Endpoint=queue_arn,
                      Attributes={"RawMessageDelivery": "true"})
        self._sqs, self._queue_url = sqs, queue_url
        self.pipeline_arn = self.sfn.create_state_machine(
            name="pipeline", roleArn=ROLE,
            definition=json.dumps(syn.definition("TrainingPipeline", values)))["stateMachineArn"]
        values[syn.logical_id(syn.stack.pipeline.state_machine)] = self.pipeline_arn
        self.starter_arn = self.sfn.create_state_machine(
            name="starter", roleArn=ROLE,
            definition=json.dumps(syn.definition("TriggerStarter", values)))["stateMachineArn"]
        self.watchdog_arn = self.sfn.create_state_machine(
            name="watchdog", roleArn=ROLE,
            definition=json.dumps(syn.definition("StallWatchdog", values)))["stateMachineArn"]
        self.queue_wait_arn = self.sfn.create_state_machine(
            name="queue-wait", roleArn=ROLE,
            definition=json.dumps(syn.definition("QueueWait", values)))["stateMachineArn"]
        self.values = values  # logical id (.attribute) -> what the mocked resources resolve it to
        self.alarm_prefix = syn.stack.watchdog.alarm_prefix
        self.job_tags = dict(syn.stack.ownership.tags)
        self.cloudwatch = boto3.client("cloudwatch", region_name=REGION)

    def run(self, machine_arn: str, name: str, payload: dict, timeout: float = 60.0) -> tuple[dict, list[str]]:
        arn = self.sfn.start_execution(stateMachineArn=machine_arn, name=name, input=json.dumps(payload))["executionArn"]
        deadline = time.monotonic() + timeout
        while (desc := self.sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
            assert time.monotonic() < deadline, "execution did not finish"
            time.sleep(0.2)
        events = self.sfn.get_execution_history(executionArn=arn, maxResults=1000)["events"]
        visited = [e["stateEnteredEventDetails"]["name"] for e in events if "stateEnteredEventDetails" in e]
        return desc, visited

    def drain(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for machine in (self.pipeline_arn, self.starter_arn, self.watchdog_arn, self.queue_wait_arn):
            while self.sfn.list_executions(stateMachineArn=machine, statusFilter="RUNNING")["executions"]:
                assert time.monotonic() < deadline, "executions still running after the test"
                time.sleep(0.2)

    def put_gate(self, run_id: str, passed: bool) -> None:
        self.s3.put_object(Bucket=ARTIFACTS, Key=f"runs/{run_id}/validation/gate.json",
                           Body=json.dumps({"passed": passed, "metrics": {"recall@10": 0.5}}))

    def put_current_model(self, run_id: str, version: str, dataset: str = "catalog") -> None:
        """A published pointer as Publish writes it (another run's)."""
        self.s3.put_object(Bucket=ARTIFACTS, Key="models/current.json", Body=json.dumps({
            "run_id": run_id, "checkpoint": f"/fsx/runs/{run_id}", "metrics": {"recall@10": 0.4},
            "dataset": dataset, "data_version": version, "started_at": "2026-01-01T00:00:00Z"}))

    def current_model(self) -> dict:
        return json.loads(self.s3.get_object(Bucket=ARTIFACTS, Key="models/current.json")["Body"].read())

    def notifications(self) -> list[str]:
        """What a subscriber without a rendering of its own receives (an SQS queue: "default")."""
        out = self._sqs.receive_message(QueueUrl=self._queue_url, MaxNumberOfMessages=10).get("Messages", [])
        return [m["Body"] for m in out]

    def published(self) -> list[tuple[str, str | None]]:
        """(Message, Subject) of every Publish to the topic, as the state machines sent it: moto's
        SNS keeps them on the topic, before each subscription takes its protocol's rendering."""
        topic = sns_backends[ENV.account][REGION].topics[self.topic_arn]
        return [(message, subject) for _, message, subject, _, _ in topic.sent_notifications]
