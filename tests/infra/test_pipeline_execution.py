"""Execute the synthesized pipeline and starter definitions with moto (see moto_batch.py for the
Batch integration patch). Jobs run against mocked Batch queues/job definitions, S3 and SNS."""

from __future__ import annotations

import json
import time

import boto3
import pytest
from moto import mock_aws

from moto_batch import patched_moto_batch
from pipeline_fixtures import ENV, JOB_DEFINITIONS, synthesized

REGION = ENV.region
ARTIFACTS = "artifacts-bucket"
DATA = "data-bucket"
ROLE = f"arn:aws:iam::{ENV.account}:role/sfn"
HAPPY_PATH = ["Defaults", "ApplyDefaults", "CheckShare", "InitFromGiven", "ReadCurrentModel", "TrainFromScratch", "ApplyBaseline",
              "Prepare", "Sanity", "Compile", "Train", "Validate", "ReadGate", "GatePassed", "Embed",
              "PointerRecord", "Publish", "NotifyPublished", "Done"]


@pytest.fixture
def aws():
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}, "batch": {"use_docker": False}}), \
            patched_moto_batch() as hooks:
        yield _World(hooks)


class _World:
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
        boto3.client("iam", region_name=REGION).create_role(RoleName="batch", AssumeRolePolicyDocument="{}")
        ce = self.batch.create_compute_environment(computeEnvironmentName="pipeline-ce", type="UNMANAGED",
            serviceRole=f"arn:aws:iam::{ENV.account}:role/batch")["computeEnvironmentArn"]
        for name, queue in deps.queues.items():
            arn = self.batch.create_job_queue(jobQueueName=name, state="ENABLED", priority=1,
                                              computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce}])["jobQueueArn"]
            lid = syn.logical_id(queue)
            values[lid] = values[f"{lid}.JobQueueArn"] = arn
        for name in JOB_DEFINITIONS:
            arn = self.batch.register_job_definition(
                jobDefinitionName=name, type="container",
                containerProperties={"image": "busybox", "vcpus": 1, "memory": 128, "command": ["true"]})["jobDefinitionArn"]
            lid = syn.logical_id(deps.job_definitions[name])
            values[lid] = values[f"{lid}.JobDefinitionArn"] = arn
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

    def run(self, machine_arn: str, name: str, payload: dict, timeout: float = 60.0) -> tuple[dict, list[str]]:
        arn = self.sfn.start_execution(stateMachineArn=machine_arn, name=name, input=json.dumps(payload))["executionArn"]
        deadline = time.monotonic() + timeout
        while (desc := self.sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
            assert time.monotonic() < deadline, "execution did not finish"
            time.sleep(0.2)
        events = self.sfn.get_execution_history(executionArn=arn, maxResults=1000)["events"]
        visited = [e["stateEnteredEventDetails"]["name"] for e in events if "stateEnteredEventDetails" in e]
        return desc, visited

    def put_gate(self, run_id: str, passed: bool) -> None:
        self.s3.put_object(Bucket=ARTIFACTS, Key=f"runs/{run_id}/validation/gate.json",
                           Body=json.dumps({"passed": passed, "metrics": {"recall@10": 0.5}}))

    def notifications(self) -> list[str]:
        out = self._sqs.receive_message(QueueUrl=self._queue_url, MaxNumberOfMessages=10).get("Messages", [])
        return [m["Body"] for m in out]


def test_happy_path_visits_every_state_in_order_and_publishes(aws):
    aws.put_gate("run-1", passed=True)
    desc, visited = aws.run(aws.pipeline_arn, "run-1", {"dataset": "catalog", "version": "v1", "data_uri": "/fsx/data/x"})
    assert desc["status"] == "SUCCEEDED", desc
    assert visited == HAPPY_PATH
    pointer = json.loads(aws.s3.get_object(Bucket=ARTIFACTS, Key="models/current.json")["Body"].read())
    assert pointer["run_id"] == "run-1" and pointer["checkpoint"] == "/fsx/runs/run-1"
    assert pointer["data_version"] == "v1" and pointer["metrics"] == {"recall@10": 0.5}
    assert pointer["checkpoint_s3_uri"] == f"s3://{ARTIFACTS}/runs/run-1/checkpoints/"
    # Every submission carries the fair-share fields and the run parameters.
    steps = [s["jobName"] for s in aws.hooks.submitted]
    assert steps == ["prepare", "sanity", "compile", "train", "validate", "embed"]
    for submit in aws.hooks.submitted:
        assert submit["shareIdentifier"] == "production" and submit["schedulingPriorityOverride"] == 50
        assert submit["parameters"]["run_id"] == "run-1" and submit["parameters"]["data_uri"] == "/fsx/data/x"
        assert submit["parameters"]["init_from"] == ""
    by_name = {s["jobName"]: s for s in aws.hooks.submitted}
    for multi in ("sanity", "compile", "train"):
        assert by_name[multi]["nodeOverrides"] == {"numNodes": 2}
    assert by_name["embed"]["arrayProperties"] == {"size": 4}
    assert by_name["validate"]["parameters"]["gate_s3_uri"] == f"s3://{ARTIFACTS}/runs/run-1/validation/gate.json"
    assert any("published" in n for n in aws.notifications())


def test_input_overrides_defaults_and_current_model_is_the_default_start(aws):
    aws.s3.put_object(Bucket=ARTIFACTS, Key="models/current.json",
                      Body=json.dumps({"run_id": "old", "checkpoint": "/fsx/runs/old"}))
    aws.put_gate("run-2", passed=True)
    desc, visited = aws.run(aws.pipeline_arn, "run-2", {"num_nodes": 4, "share": "experiments", "priority": 7,
                                                        "embed_shards": 3})
    assert desc["status"] == "SUCCEEDED", desc
    assert "UseCurrentModel" in visited and "TrainFromScratch" not in visited
    by_name = {s["jobName"]: s for s in aws.hooks.submitted}
    assert by_name["train"]["parameters"]["init_from"] == "/fsx/runs/old"
    assert by_name["validate"]["parameters"]["previous_metrics"] == "/fsx/runs/old/validation/metrics.json"
    assert by_name["train"]["nodeOverrides"] == {"numNodes": 4}
    assert by_name["train"]["shareIdentifier"] == "experiments" and by_name["train"]["schedulingPriorityOverride"] == 7
    assert by_name["embed"]["arrayProperties"] == {"size": 3}
    assert by_name["embed"]["parameters"]["shard_count"] == "3"


def test_a_share_the_policy_does_not_define_fails_before_any_job(aws):
    # Batch would run it with the default weight: the fair share would decide nothing.
    desc, visited = aws.run(aws.pipeline_arn, "run-share", {"share": "research"})
    assert desc["status"] == "FAILED", desc
    assert visited[-2:] == ["CheckShare", "UnknownShare"]
    assert not aws.hooks.submitted


def test_failing_train_job_takes_the_failure_path_and_notifies(aws):
    aws.hooks.fail_job_definitions.add("train")
    desc, visited = aws.run(aws.pipeline_arn, "run-3", {"init_from": "/fsx/runs/x"})
    assert desc["status"] == "FAILED"
    assert visited[-3:] == ["Train", "NotifyFailure", "Failed"]
    assert "Validate" not in visited
    (message,) = [n for n in aws.notifications() if "failed" in n]
    assert "run-3" in message and '"Train"' in message and "JobId" in message


def test_failing_gate_skips_embed_and_publish(aws):
    aws.put_gate("run-4", passed=False)
    desc, visited = aws.run(aws.pipeline_arn, "run-4", {})
    assert desc["status"] == "SUCCEEDED"
    assert visited[-3:] == ["GatePassed", "NotifyGateFailed", "ModelRejected"]
    assert "Embed" not in visited and "Publish" not in visited
    with pytest.raises(aws.s3.exceptions.NoSuchKey):
        aws.s3.get_object(Bucket=ARTIFACTS, Key="models/current.json")
    assert any("quality gate" in n for n in aws.notifications())


def test_throttled_submit_is_retried(aws):
    aws.put_gate("run-5", passed=True)
    aws.hooks.throttle_submits = 2
    desc, visited = aws.run(aws.pipeline_arn, "run-5", {})
    assert desc["status"] == "SUCCEEDED", desc
    assert aws.hooks.throttled == 2
    assert visited == HAPPY_PATH  # a retry stays inside the state: no extra state entered


def test_s3_event_starts_one_run_named_after_dataset_and_version(aws):
    event = {"source": "aws.s3", "detail-type": "Object Created",
             "detail": {"bucket": {"name": DATA}, "object": {"key": "incoming/catalog/2026-01-05/_SUCCESS"}}}
    desc, visited = aws.run(aws.starter_arn, "evt-1", event)
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-1] == "Started"
    (execution,) = aws.sfn.list_executions(stateMachineArn=aws.pipeline_arn)["executions"]
    assert execution["name"] == "catalog-2026-01-05"
    run_input = json.loads(aws.sfn.describe_execution(executionArn=execution["executionArn"])["input"])
    assert run_input == {"dataset": "catalog", "version": "2026-01-05",
                         "data_uri": "/fsx/data/incoming/catalog/2026-01-05",
                         "data_s3_uri": f"s3://{DATA}/incoming/catalog/2026-01-05/",
                         "source_key": "incoming/catalog/2026-01-05/_SUCCESS"}
    # Let the first run finish, then deliver the same event again: no second run.
    deadline = time.monotonic() + 60
    while aws.sfn.describe_execution(executionArn=execution["executionArn"])["status"] == "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    desc, visited = aws.run(aws.starter_arn, "evt-2", event)
    assert desc["status"] == "SUCCEEDED" and visited[-1] == "AlreadyStarted"
    assert len(aws.sfn.list_executions(stateMachineArn=aws.pipeline_arn)["executions"]) == 1


def test_marker_at_the_wrong_depth_fails_the_starter(aws):
    event = {"detail": {"bucket": {"name": DATA}, "object": {"key": "incoming/catalog/_SUCCESS"}}}
    desc, visited = aws.run(aws.starter_arn, "evt-3", event)
    assert desc["status"] == "FAILED" and visited[-1] == "UnexpectedKey"
    assert aws.sfn.list_executions(stateMachineArn=aws.pipeline_arn)["executions"] == []
