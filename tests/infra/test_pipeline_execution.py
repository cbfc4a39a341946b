"""Execute the synthesized pipeline and starter definitions with moto (see moto_batch.py for the
Batch integration patch). Jobs run against mocked Batch queues/job definitions, S3 and SNS."""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from unittest import mock

import boto3
import pytest
from moto import mock_aws
from moto.batch import batch_backends
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_callback as callback_module,
)

from stacks.constructs.stall_watchdog import HEARTBEAT_POLL_MINUTES
from tests.chatbot_notification import custom_notification_content
from tests.infra.moto_batch import patched_moto_batch
from tests.infra.pipeline_fixtures import ENV, QUEUE_WAIT, TEST_CONFIG
from tests.infra.pipeline_world import ARTIFACTS, DATA, REGION, PipelineWorld

INPUT_CHECKS = ["PrepareInputChecks", "Check_dataset", "Check_version", "Check_data_uri", "Check_init_from",
                "Check_num_nodes", "Check_embed_shards", "Check_prepare_shards", "Check_priority", "Check_share",
                "InputValid", "LocateData", "DataDepth", "DataPrefix_3", "ListData", "DataFound"]
HAPPY_PATH = ["InputShape", "InputIsObject", "Defaults", "ApplyDefaults", *INPUT_CHECKS, "ReadCurrentModel", "NoProductionModel", "ApplyBaseline",
              "Prepare", "PrepareShards", "PrepareFinish", "Sanity", "Compile", "Train", "Validate", "ReadGate", "GateReportValid", "GatePassed", "Embed",
              "Export", "ReadPublishedModel", "PointerRecord", "Publish", "NotifyPublishedMessage", "NotifyPublished",
              "Done"]


def data(upload: str = "catalog/v1", **extra) -> dict:
    """An execution input for one of UPLOADS."""
    dataset, version = upload.split("/")
    return {"dataset": dataset, "version": version, "data_uri": f"/fsx/data/incoming/{upload}", **extra}


@pytest.fixture
def aws():
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}, "batch": {"use_docker": False}}), \
            patched_moto_batch() as hooks, \
            mock.patch.object(callback_module, "_DELAY_SECONDS_SYNC_CONDITION_CHECK", 0.05):  # faster .sync polls
        hooks.instant_waits = True  # the watchdog's Waits
        world = PipelineWorld(hooks)
        yield world
        world.drain()  # a run a test left going (the starter's) must not publish into the next test's topic


def test_happy_path_visits_every_state_in_order_and_publishes(aws):
    aws.put_gate("run-1", passed=True)
    desc, visited = aws.run(aws.pipeline_arn, "run-1", data())
    assert desc["status"] == "SUCCEEDED", desc
    assert visited == HAPPY_PATH
    pointer = aws.current_model()
    assert pointer["run_id"] == "run-1" and pointer["checkpoint"] == "/fsx/runs/run-1"
    assert pointer["data_version"] == "v1" and pointer["metrics"] == {"recall@10": 0.5}
    assert pointer["checkpoint_s3_uri"] == f"s3://{ARTIFACTS}/runs/run-1/checkpoints/"
    # The export the Export job uploaded itself (complete once its _SUCCESS marker exists).
    assert pointer["export_uri"] == f"s3://{ARTIFACTS}/runs/run-1/export/"
    # Every submission carries the fair-share fields and the run parameters.
    steps = [s["jobName"] for s in aws.hooks.submitted]
    assert steps == ["prepare", "prepare-shards", "prepare-finish", "sanity", "compile", "train", "validate", "embed",
                     "export"]
    for submit in aws.hooks.submitted:
        assert submit["shareIdentifier"] == "production" and submit["schedulingPriorityOverride"] == 50
        assert submit["parameters"]["run_id"] == "run-1"
        assert submit["parameters"]["data_uri"] == "/fsx/data/incoming/catalog/v1"
        assert submit["parameters"]["init_from"] == ""
        assert submit["tags"] == aws.job_tags == {"pipeline": "Pipeline"}  # what TerminateJob is scoped to
    by_name = {s["jobName"]: s for s in aws.hooks.submitted}
    for multi in ("sanity", "compile", "train"):
        assert by_name[multi]["nodeOverrides"] == {"numNodes": 2}
    assert by_name["embed"]["arrayProperties"] == {"size": 4}
    assert by_name["prepare-shards"]["arrayProperties"] == {"size": 4}
    assert by_name["prepare-shards"]["parameters"]["shard_count"] == by_name["prepare-finish"]["parameters"]["shard_count"] == "4"
    assert "arrayProperties" not in by_name["prepare"] and "arrayProperties" not in by_name["prepare-finish"]
    assert by_name["validate"]["parameters"]["gate_s3_uri"] == f"s3://{ARTIFACTS}/runs/run-1/validation/gate.json"
    assert by_name["export"]["parameters"]["export_s3_uri"] == f"s3://{ARTIFACTS}/runs/run-1/export/"
    assert any("published" in n for n in aws.notifications())


def test_input_overrides_defaults_and_current_model_is_the_default_start(aws):
    aws.put_current_model("old", "v1")
    aws.put_gate("run-2", passed=True)
    desc, visited = aws.run(aws.pipeline_arn, "run-2", data("catalog/v2", num_nodes=4, share="experiments",
                                                             priority=7, embed_shards=3, prepare_shards=12))
    assert desc["status"] == "SUCCEEDED", desc
    assert "UseCurrentModel" in visited and "NoProductionModel" not in visited
    by_name = {s["jobName"]: s for s in aws.hooks.submitted}
    assert by_name["train"]["parameters"]["init_from"] == "/fsx/runs/old"
    assert by_name["validate"]["parameters"]["previous_metrics"] == "/fsx/runs/old/validation/metrics.json"
    assert by_name["train"]["nodeOverrides"] == {"numNodes": 4}
    assert by_name["train"]["shareIdentifier"] == "experiments" and by_name["train"]["schedulingPriorityOverride"] == 7
    assert by_name["embed"]["arrayProperties"] == {"size": 3}
    assert by_name["embed"]["parameters"]["shard_count"] == "3"
    assert by_name["prepare-shards"]["arrayProperties"] == {"size": 12}
    assert by_name["prepare-shards"]["parameters"]["shard_count"] == by_name["prepare-finish"]["parameters"]["shard_count"] == "12"


def test_a_share_the_policy_does_not_define_fails_before_any_job(aws):
    # Batch would run it with the default weight: the fair share would decide nothing.
    desc, visited = aws.run(aws.pipeline_arn, "run-share", data(share="research"))
    assert desc["status"] == "FAILED", desc
    assert "Invalid_share" in visited and "InvalidInput" in visited
    assert not aws.hooks.submitted


def test_incremental_run_from_a_given_model_is_gated_against_production(aws):
    # trainium-runs start --base-model sends init_from: it decides where training starts, never the
    # baseline, so a run from any model is compared with the production metrics.
    aws.put_current_model("prod-run", "v1")
    aws.put_gate("run-inc", passed=True)
    desc, visited = aws.run(aws.pipeline_arn, "run-inc", data("catalog/v2", init_from="/fsx/runs/some-experiment",
                                                               previous_metrics=""))
    assert desc["status"] == "SUCCEEDED", desc
    assert "ReadCurrentModel" in visited
    by_name = {s["jobName"]: s for s in aws.hooks.submitted}
    assert by_name["train"]["parameters"]["init_from"] == "/fsx/runs/some-experiment"
    assert by_name["validate"]["parameters"]["previous_metrics"] == "/fsx/runs/prod-run/validation/metrics.json"


def test_failing_train_job_takes_the_failure_path_and_notifies(aws):
    aws.hooks.fail_job_definitions.add("train")
    desc, visited = aws.run(aws.pipeline_arn, "run-3", data(init_from="/fsx/runs/x"))
    assert desc["status"] == "FAILED"
    assert visited[-5:] == ["Train", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    assert "Validate" not in visited
    (message,) = [n for n in aws.notifications() if "failed" in n]
    assert "run-3" in message and '"Train"' in message and "JobId" in message


# ---- the failure path: classified from the job's logs, and never blocked by the classifier ----
JOB_LOG_GROUP = "/aws/batch/job"  # the job definitions here set no awslogs group: Batch's default
TRAIN_LOG = [
    "2026-11-24T03:05:40 INFO pipeline_steps.progress: train step 900/2000  loss=2.01",
    "2026-Nov-24 03:05:49.7287 2301:2410 ERROR  TDRV:tdrv_init  Uncorrectable HBM memory error is detected",
    "2026-11-24T03:05:52 ERROR pipeline_steps.train: train step: a peer of rank 0 of 16 went away "
    "(Connection reset by peer) (exit 75: retryable)",
]


def _fail_job_with_log(aws, job_name: str, lines: list[str], *, exit_code: int, reason: str) -> None:
    """Jobs of `job_name` write `lines` to their CloudWatch stream and fail as Batch reports it."""
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_group(logGroupName=JOB_LOG_GROUP)
    start = int(time.time() * 1000)

    def run_job(job, submitted) -> bool:
        if job.job_definition.name != job_name:
            return True
        logs.create_log_stream(logGroupName=JOB_LOG_GROUP, logStreamName=job._stream_name)
        logs.put_log_events(logGroupName=JOB_LOG_GROUP, logStreamName=job._stream_name, logEvents=[
            {"timestamp": start + i, "message": line} for i, line in enumerate(lines)])
        job.attempts.append({"container": {"exitCode": exit_code, "logStreamName": job._stream_name},
                             "statusReason": reason})
        job.exit_code, job.job_stopped_reason = exit_code, reason
        return False

    aws.hooks.run_job = run_job


def test_a_failed_job_is_classified_from_its_log_and_the_notification_says_what_to_do(aws):
    _fail_job_with_log(aws, "train", TRAIN_LOG, exit_code=75, reason="Essential container in task exited")
    desc, visited = aws.run(aws.pipeline_arn, "run-hbm", data())
    assert desc["status"] == "FAILED"
    assert visited[-5:] == ["Train", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    (result,) = aws.hooks.lambda_results
    assert result["class"] == "device_unavailable" and result["step"] == "Train" and result["retryable"] is True
    assert result["subject"] == "Run run-hbm failed in Train: device_unavailable"
    (message,) = [n for n in aws.notifications() if "failed" in n]
    assert "Failed step: Train (job " in message and "Class: device_unavailable" in message
    assert "[main line 2] 2026-Nov-24 03:05:49.7287 2301:2410 ERROR  TDRV:tdrv_init  Uncorrectable HBM" in message
    assert "Suggestion: A hardware error" in message and "Docs: https://" in message
    assert '"Train":{"Error":"States.TaskFailed"' in message and "JobId" in message  # the raw failure too
    # One metric per class: the embedded-metric-format line CloudWatch turns into PipelineFailures.
    (emf,) = [json.loads(line) for line in aws.hooks.lambda_stdout if line.startswith("{")]
    assert (emf["Class"], emf["PipelineFailures"], emf["step"]) == ("device_unavailable", 1, "Train")
    assert emf["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["Stage", "Class"]]


def _renderings(aws, subject_has: str) -> tuple[str, dict]:
    """The e-mail text and the chat content of the one notification whose subject has `subject_has`."""
    ((message, subject),) = [(m, s) for m, s in aws.published() if subject_has in (s or "")]
    renderings = json.loads(message)  # MessageStructure json: one rendering per protocol
    assert set(renderings) == {"default", "email", "https"} and renderings["default"] == renderings["email"]
    content = custom_notification_content(json.loads(renderings["https"]))
    assert content["title"] == subject
    return renderings["email"], content


def test_the_failure_reaches_email_as_text_and_slack_as_a_custom_notification(aws):
    _fail_job_with_log(aws, "train", TRAIN_LOG, exit_code=75, reason="Essential container in task exited")
    desc, _ = aws.run(aws.pipeline_arn, "run-chat", data())
    assert desc["status"] == "FAILED"
    email, chat = _renderings(aws, "run-chat failed")
    assert [email] == [n for n in aws.notifications() if "failed" in n]  # what e-mail and SQS receive
    assert email.startswith("Run run-chat failed. Failed step: Train (job ")
    (result,) = aws.hooks.lambda_results
    description = chat["description"]
    assert description.startswith(f"*Failed step:* Train (job {result['job_id']})\n*Class:* `device_unavailable` ")
    assert "*First error on:* main" in description
    assert "```\n[main line 2] 2026-Nov-24 03:05:49.7287 2301:2410 ERROR  TDRV:tdrv_init  Uncorrectable HBM" \
        in description
    assert "JobId" not in description  # the raw DescribeJobs record stays in the e-mail
    suggestion, docs, why = chat["nextSteps"]
    assert suggestion == result["suggestion"] and suggestion.startswith("A hardware error")
    assert docs == f"Docs: {result['docs']}" and "`trainium-runs why run-chat`" in why
    assert chat["keywords"] == ["device_unavailable", "Train"]


def test_a_failing_classifier_never_blocks_the_notification_nor_hides_the_failure(aws):
    aws.hooks.fail_job_definitions.add("train")
    aws.hooks.fail_lambda = True
    desc, visited = aws.run(aws.pipeline_arn, "run-noclass", data())
    assert desc["status"] == "FAILED"
    assert visited[-6:] == ["Train", "DiagnoseFailure", "DiagnosisUnavailable", "NotifyFailureMessage", "NotifyFailure",
                            "Failed"]
    (message,) = [n for n in aws.notifications() if "failed" in n]
    assert message.startswith("Run run-noclass failed. (The automatic classification failed: RuntimeError.)")
    assert '"Train":{"Error":"States.TaskFailed"' in message and "JobId" in message
    email, chat = _renderings(aws, "run failed")
    assert email == message and chat["keywords"] == ["unclassified"]
    assert chat["description"].startswith("The automatic classification failed (RuntimeError)")
    assert chat["nextSteps"] == ["`trainium-runs why run-noclass` classifies the failure from the job logs"]


def test_a_classifier_returning_nothing_usable_still_notifies(aws):
    # A function error of any kind (here: the handler raising on its input) is caught alike.
    aws.hooks.fail_job_definitions.add("train")
    aws.hooks.lambda_handler = lambda event, context: {}["missing"]
    desc, visited = aws.run(aws.pipeline_arn, "run-keyerror", data())
    assert desc["status"] == "FAILED" and "DiagnosisUnavailable" in visited
    (message,) = [n for n in aws.notifications() if "failed" in n]
    assert "(The automatic classification failed: KeyError.)" in message and "JobId" in message


def test_failing_gate_skips_embed_and_publish(aws):
    aws.put_gate("run-4", passed=False)
    desc, visited = aws.run(aws.pipeline_arn, "run-4", data())
    assert desc["status"] == "SUCCEEDED"
    assert visited[-4:] == ["GatePassed", "NotifyGateFailedMessage", "NotifyGateFailed", "ModelRejected"]
    assert "Embed" not in visited and "Export" not in visited and "Publish" not in visited
    with pytest.raises(aws.s3.exceptions.NoSuchKey):
        aws.s3.get_object(Bucket=ARTIFACTS, Key="models/current.json")
    (message,) = [n for n in aws.notifications() if "quality gate" in n]
    email, chat = _renderings(aws, "quality gate")
    assert email == chat["description"] == message and '"passed":false' in message


def test_throttled_submit_is_retried(aws):
    aws.put_gate("run-5", passed=True)
    aws.hooks.throttle_submits = 2
    desc, visited = aws.run(aws.pipeline_arn, "run-5", data())
    assert desc["status"] == "SUCCEEDED", desc
    assert aws.hooks.throttled == 2
    assert visited == HAPPY_PATH  # a retry stays inside the state: no extra state entered


# ---- input checks: before any Batch job, one notification that says what to fix --------------
def test_empty_input_fails_before_any_job_with_one_notification_listing_the_fixes(aws):
    desc, visited = aws.run(aws.pipeline_arn, "run-empty", {})
    assert desc["status"] == "FAILED"
    assert aws.hooks.submitted == []
    assert visited[-5:] == ["InvalidInput", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    (message,) = aws.notifications()
    assert "run-empty" in message and "version: the data version" in message
    assert "Failed step: InvalidInput" in message and "Class: bad_config" in message
    assert "data_uri: the upload directory /fsx/data/incoming/<dataset>/<version>" in message
    assert "num_nodes" not in message  # defaults are valid


@pytest.mark.parametrize("bad, fixes", [
    ({"dataset": "a/b", "num_nodes": 2.5, "embed_shards": "3", "priority": None, "share": "nobody",
      "init_from": "s3://bucket/run", "data_uri": "/data/x"},
     ["dataset: a non-empty name", "num_nodes: an integer 1..4", "embed_shards: an integer 2..10000",
      "priority: an integer 0..9999", "share: one of the fair-share identifiers of the training queue",
      "init_from: a run directory", "data_uri: the upload directory"]),
    ({"num_nodes": 99, "embed_shards": 1, "priority": 10_000},
     ["num_nodes: an integer 1..4", "embed_shards: an integer 2..10000", "priority: an integer 0..9999"]),
    ({"prepare_shards": 10_001}, ["prepare_shards: an integer 2..10000 (the size of the Batch array job"]),
    ({"prepare_shards": 2.5}, ["prepare_shards: an integer 2..10000"]),
])
def test_every_bad_field_is_named_in_one_notification_before_any_job(aws, bad, fixes):
    desc, visited = aws.run(aws.pipeline_arn, "run-bad", data(**bad))
    assert desc["status"] == "FAILED" and aws.hooks.submitted == []
    assert visited[-5:] == ["InvalidInput", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    (message,) = aws.notifications()
    for fix in fixes:
        assert fix in message
    assert message.split("Raw failure")[1].count("; ") == len(fixes)  # the evidence line quotes them too


def test_missing_data_fails_before_any_job(aws):
    desc, visited = aws.run(aws.pipeline_arn, "run-nodata", data("catalog/v9"))
    assert desc["status"] == "FAILED" and aws.hooks.submitted == []
    assert visited[-6:] == ["DataFound", "NoData", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    (message,) = aws.notifications()
    assert f"No objects under s3://{DATA}/incoming/catalog/v9/" in message
    assert "Class: bad_input" in message


@pytest.mark.parametrize("payload", [[1, 2], "catalog/v1", 3, None, True, []])
def test_an_input_that_is_not_a_json_object_reaches_the_failure_notification(aws, payload):
    desc, visited = aws.run(aws.pipeline_arn, "run-shape", payload)
    assert desc["status"] == "FAILED" and aws.hooks.submitted == []
    assert visited == ["InputShape", "InputIsObject", "InputNotAnObject", "DiagnoseFailure", "NotifyFailureMessage",
                       "NotifyFailure", "Failed"]
    (message,) = [n for n in aws.notifications() if "run-shape" in n]
    assert "The execution input must be a JSON object" in message


# ---- notifications cannot change the outcome -------------------------------------------------
def test_undelivered_published_notification_leaves_a_succeeded_run(aws):
    aws.put_gate("run-quiet", passed=True)
    aws.hooks.fail_sns_subjects.add("new model published")
    desc, visited = aws.run(aws.pipeline_arn, "run-quiet", data())
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-4:] == ["NotifyPublishedMessage", "NotifyPublished", "NotifyPublishedUndelivered", "Done"]
    assert aws.current_model()["run_id"] == "run-quiet"
    assert aws.hooks.sns_attempts["new model published"] == 1 + TEST_CONFIG.retry_max_attempts


# ---- conditional publish: an older run never replaces a newer model ---------------------------
def test_run_of_an_older_version_finishing_last_does_not_replace_the_newer_model(aws):
    aws.put_gate("run-new", passed=True)
    aws.put_gate("run-old", passed=True)
    assert aws.run(aws.pipeline_arn, "run-new", data("catalog/v2"))[0]["status"] == "SUCCEEDED"
    desc, visited = aws.run(aws.pipeline_arn, "run-old", data("catalog/v1"))
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-4:] == ["NewerModelPublished", "NotifySupersededMessage", "NotifySuperseded", "ModelSuperseded"]
    assert aws.current_model()["run_id"] == "run-new"
    assert any("was not published" in n and "run-new" in n for n in aws.notifications())


def test_newer_version_replaces_with_a_conditional_write(aws):
    aws.put_gate("run-a", passed=True)
    aws.put_gate("run-b", passed=True)
    assert aws.run(aws.pipeline_arn, "run-a", data("catalog/v1"))[0]["status"] == "SUCCEEDED"
    desc, visited = aws.run(aws.pipeline_arn, "run-b", data("catalog/v2"))
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-5:] == ["PointerRecordReplace", "PublishReplacement", "NotifyPublishedMessage", "NotifyPublished",
                            "Done"]
    assert aws.current_model()["run_id"] == "run-b"


def test_publish_race_a_newer_model_written_between_read_and_write_wins(aws):
    # run-old read the pointer of run-a (v1), then run-new (v3) published before run-old's write:
    # the If-Match write fails with 412, run-old reads again, sees v3 and stands down.
    aws.put_current_model("run-a", "v1")
    aws.put_gate("run-old", passed=True)
    aws.hooks.before_put_current.append(lambda: aws.put_current_model("run-new", "v3"))
    desc, visited = aws.run(aws.pipeline_arn, "run-old", data("catalog/v2"))
    assert desc["status"] == "SUCCEEDED", desc
    conflict = visited.index("PublishConflict")
    assert visited[conflict - 1] == "PublishReplacement"
    assert visited[conflict + 1:] == ["PublishAgain", "ReadPublishedModel", "NewerModelPublished",
                                      "NotifySupersededMessage", "NotifySuperseded", "ModelSuperseded"]
    assert aws.current_model()["run_id"] == "run-new"


def test_first_publish_race_creates_only_once(aws):
    # Both runs saw no pointer; the other one created it first: If-None-Match makes ours fail,
    # and the newer version on the second read wins.
    aws.put_gate("run-late", passed=True)
    aws.hooks.before_put_current.append(lambda: aws.put_current_model("run-first", "v3"))
    desc, visited = aws.run(aws.pipeline_arn, "run-late", data("catalog/v2"))
    assert desc["status"] == "SUCCEEDED", desc
    assert visited.count("ReadPublishedModel") == 2 and "PublishConflict" in visited
    assert visited[-3:] == ["NotifySupersededMessage", "NotifySuperseded", "ModelSuperseded"]
    assert aws.current_model()["run_id"] == "run-first"


# ---- malformed documents fail loudly ---------------------------------------------------------
def test_current_model_without_checkpoint_fails_with_a_notification(aws):
    aws.s3.put_object(Bucket=ARTIFACTS, Key="models/current.json", Body=json.dumps({"run_id": "old"}))
    desc, visited = aws.run(aws.pipeline_arn, "run-m1", data())
    assert desc["status"] == "FAILED" and aws.hooks.submitted == []
    assert visited[-5:] == ["MalformedCurrentModel", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure",
                            "Failed"]
    (message,) = aws.notifications()
    assert "needs string fields checkpoint and run_id" in message


def test_gate_report_without_metrics_fails_with_a_notification(aws):
    aws.s3.put_object(Bucket=ARTIFACTS, Key="runs/run-m2/validation/gate.json", Body=json.dumps({"passed": True}))
    desc, visited = aws.run(aws.pipeline_arn, "run-m2", data())
    assert desc["status"] == "FAILED"
    assert visited[-5:] == ["MalformedGateReport", "DiagnoseFailure", "NotifyFailureMessage", "NotifyFailure", "Failed"]
    assert "Embed" not in visited
    (message,) = aws.notifications()
    assert "needs a boolean passed and a metrics object" in message


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


# ---- stall watchdog: arm on the first heartbeat, terminate a stalled job, disarm ------------
POLL_SECONDS = HEARTBEAT_POLL_MINUTES * 60


def _running_train_job(aws, run_id: str, *, queue: str = "training", tags: dict | None = None) -> dict:
    """A train job of this pipeline (its tags, the training queue) that stays RUNNING."""
    aws.hooks.running_job_definitions.add("train")
    job_id = aws.batch.submit_job(jobName="train", jobQueue=queue, jobDefinition="train", parameters={"run_id": run_id},
                                  tags=aws.job_tags if tags is None else tags)["jobId"]
    return aws.batch.describe_jobs(jobs=[job_id])["jobs"][0]


def _job_event(job: dict, status: str, *, started_at: int | None = None) -> dict:
    detail = {"jobId": job["jobId"], "jobName": job["jobName"], "status": status,
              "parameters": job["parameters"], "attempts": []}
    if status == "RUNNING":
        detail["startedAt"] = job["startedAt"] if started_at is None else started_at
    return {"source": "aws.batch", "detail-type": "Batch Job State Change", "time": _iso(minutes_ago=60),
            "detail": detail}


def _iso(minutes_ago: float = 0) -> str:
    moment = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=minutes_ago)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _alarms(aws) -> list[dict]:
    return aws.cloudwatch.describe_alarms(AlarmNamePrefix=aws.alarm_prefix)["MetricAlarms"]


def _heartbeat(aws, run_id: str, step: int, minutes_ago: float = 0) -> None:
    aws.cloudwatch.put_metric_data(Namespace="TrainiumEmbeddings", MetricData=[{
        "MetricName": "TrainStep", "Value": step, "Unit": "Count",
        "Timestamp": datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=minutes_ago),
        "Dimensions": [{"Name": "Stage", "Value": "dev"}, {"Name": "RunId", "Value": run_id}]}])


def _arm(aws, run_id: str, heartbeats=((1, 1),)) -> tuple[dict, list[str], dict]:
    """A running train job that sent `heartbeats` (step, minutes ago): armed on the first poll."""
    job = _running_train_job(aws, run_id)
    for step, minutes_ago in heartbeats:
        _heartbeat(aws, run_id, step, minutes_ago)
    desc, visited = aws.run(aws.watchdog_arn, f"arm-{run_id}", _job_event(job, "RUNNING"))
    assert desc["status"] == "SUCCEEDED", desc
    return job, visited, desc


def _alarm_event(alarm: dict) -> dict:
    return {"source": "aws.cloudwatch", "detail-type": "CloudWatch Alarm State Change", "time": _iso(),
            "detail": {"alarmName": alarm["AlarmName"], "configuration": {"description": alarm["AlarmDescription"]},
                       "state": {"value": "ALARM", "reason": "Threshold Crossed"}}}


def test_watchdog_arms_on_the_first_heartbeat_however_late_it_comes(aws):
    # A healthy slow start: the first step comes after the startup bound (graph loading, the
    # in-process watchdog's first-step allowance). No alarm exists until the heartbeat does.
    job = _running_train_job(aws, "run-w1")
    late_polls = TEST_CONFIG.startup_minutes // HEARTBEAT_POLL_MINUTES + 3

    def heartbeat_late(waits: int) -> None:
        assert _alarms(aws) == [], f"alarm armed before the first heartbeat (after {waits} polls)"
        if waits == late_polls:  # sent during this wait (a little before the poll reads it)
            _heartbeat(aws, "run-w1", step=1, minutes_ago=0.5)

    aws.hooks.on_wait = heartbeat_late
    desc, visited = aws.run(aws.watchdog_arn, "arm-w1", _job_event(job, "RUNNING"))
    assert desc["status"] == "SUCCEEDED", desc
    assert aws.hooks.waits == [POLL_SECONDS] * late_polls
    assert visited.count("ReadFirstHeartbeat") == late_polls and visited[-2:] == ["ArmStallAlarm", "Armed"]
    (alarm,) = _alarms(aws)
    assert alarm["AlarmName"] == f"{aws.alarm_prefix}/{job['jobId']}"
    assert alarm["TreatMissingData"] == "breaching" and alarm["Period"] == 60
    assert alarm["EvaluationPeriods"] == alarm["DatapointsToAlarm"] == TEST_CONFIG.stall_timeout_minutes
    assert {"Name": "RunId", "Value": "run-w1"} in alarm["Dimensions"]
    assert json.loads(alarm["AlarmDescription"])["job_id"] == job["jobId"]


def test_watchdog_arms_when_no_heartbeat_comes_within_the_bound(aws):
    # Too frozen to emit a first heartbeat or to exit: armed (and, all data missing, alarming) at
    # first_heartbeat_minutes, never earlier.
    job = _running_train_job(aws, "run-w0")
    desc, visited = aws.run(aws.watchdog_arn, "arm-w0", _job_event(job, "RUNNING"), timeout=180)
    assert desc["status"] == "SUCCEEDED", desc
    assert sum(aws.hooks.waits) >= TEST_CONFIG.first_heartbeat_minutes * 60
    assert sum(aws.hooks.waits) - POLL_SECONDS < TEST_CONFIG.first_heartbeat_minutes * 60
    assert visited[-3:] == ["PollsLeft", "ArmStallAlarm", "Armed"] and len(_alarms(aws)) == 1


def test_watchdog_arms_nothing_when_the_attempt_ended_or_was_retried(aws):
    ended = aws.batch.describe_jobs(jobs=[aws.batch.submit_job(
        jobName="train", jobQueue="training", jobDefinition="train", parameters={"run_id": "run-w2"})["jobId"]])
    desc, visited = aws.run(aws.watchdog_arn, "arm-ended", _job_event(ended["jobs"][0], "RUNNING"))
    assert desc["status"] == "SUCCEEDED" and visited[-1] == "AttemptEnded"
    retried = _running_train_job(aws, "run-w3")  # running again, but a later attempt than the event's
    desc, visited = aws.run(aws.watchdog_arn, "arm-retried",
                            _job_event(retried, "RUNNING", started_at=retried["startedAt"] - 3_600_000))
    assert desc["status"] == "SUCCEEDED" and visited[-1] == "AttemptEnded"
    assert _alarms(aws) == []


def test_watchdog_terminates_a_stalled_job_and_names_run_job_and_last_step(aws):
    job, _, _ = _arm(aws, "run-w4", heartbeats=((100, 50), (120, 40)))
    (alarm,) = _alarms(aws)
    desc, visited = aws.run(aws.watchdog_arn, "alarm-w4", _alarm_event(alarm))
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-6:] == ["LastStepFromHeartbeat", "TerminateStalledJob", "NotifyTerminatedMessage",
                            "NotifyTerminated",
                            "DisarmAfterTerminate", "DisarmAfterTerminateDone"]
    (message,) = aws.notifications()
    assert "Run run-w4" in message and job["jobId"] in message and "Last completed step: 120" in message
    (record,) = aws.batch.describe_jobs(jobs=[job["jobId"]])["jobs"]
    assert "stall watchdog" in record["statusReason"]
    assert _alarms(aws) == []


def _alarm_naming(aws, job: dict, run_id: str) -> dict:
    """The alarm the arm path puts for `job` (or anyone who may put an alarm of that name)."""
    watch = {"run_id": run_id, "job_id": job["jobId"], "job_started_at": _iso(minutes_ago=130),
             "started_at_ms": job["startedAt"]}
    return {"AlarmName": f"{aws.alarm_prefix}/{job['jobId']}", "AlarmDescription": json.dumps(watch)}


@pytest.mark.parametrize("owner", ["another pipeline's tags", "no tags", "another queue"])
def test_watchdog_never_terminates_a_job_that_is_not_this_pipelines(aws, owner):
    aws.batch.create_job_queue(jobQueueName="other", state="ENABLED", priority=1, computeEnvironmentOrder=[
        {"order": 1, "computeEnvironment": "pipeline-ce"}])
    job = _running_train_job(aws, "run-f", queue="other" if owner == "another queue" else "training",
                             tags={"another pipeline's tags": {"pipeline": "Other-Pipeline"}, "no tags": {}}.get(owner))
    desc, visited = aws.run(aws.watchdog_arn, "alarm-foreign", _alarm_event(_alarm_naming(aws, job, "run-f")))
    assert desc["status"] == "FAILED" and visited[-1] == "NotThisPipelinesJob"
    assert "TerminateStalledJob" not in visited and aws.notifications() == []
    (record,) = aws.batch.describe_jobs(jobs=[job["jobId"]])["jobs"]
    assert record["status"] == "RUNNING"


def test_watchdog_terminate_without_any_heartbeat_says_so(aws):
    job = _running_train_job(aws, "run-w5")  # armed at first_heartbeat_minutes without a heartbeat
    desc, visited = aws.run(aws.watchdog_arn, "alarm-w5", _alarm_event(_alarm_naming(aws, job, "run-w5")))
    assert desc["status"] == "SUCCEEDED", desc
    assert "NoHeartbeatYet" in visited and "TerminateStalledJob" in visited
    assert "Last completed step: none" in aws.notifications()[0]


@pytest.mark.parametrize("status", ["SUCCEEDED", "FAILED", "RUNNABLE"])
def test_watchdog_disarms_when_the_attempt_stops_running(aws, status):
    job, _, _ = _arm(aws, f"run-d-{status.lower()}")
    assert len(_alarms(aws)) == 1
    desc, visited = aws.run(aws.watchdog_arn, f"end-{status}", _job_event(job, status))
    assert desc["status"] == "SUCCEEDED" and visited == ["Route", "DisarmStallAlarm", "DisarmStallAlarmDone"]
    assert _alarms(aws) == []


def test_watchdog_leaves_a_job_that_already_ended_alone(aws):
    job, _, _ = _arm(aws, "run-w6")
    (alarm,) = _alarms(aws)
    batch_backends[ENV.account][REGION]._jobs[job["jobId"]]._mark_stopped(success=True)  # ended meanwhile
    desc, visited = aws.run(aws.watchdog_arn, "alarm-w6", _alarm_event(alarm))
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-3:] == ["StillRunning", "DisarmEndedJobAlarm", "DisarmEndedJobAlarmDone"]
    assert "TerminateStalledJob" not in visited and aws.notifications() == []
    assert _alarms(aws) == []


# ---- queue wait: every job, not only the queue's head, waits at most the bound -----------------
def _runnable_job(aws, definition: str = "prepare", queue: str = "single-node") -> dict:
    aws.hooks.runnable_job_definitions.add(definition)
    job_id = aws.batch.submit_job(jobName=definition, jobQueue=queue, jobDefinition=definition,
                                  tags=aws.job_tags)["jobId"]
    return aws.batch.describe_jobs(jobs=[job_id])["jobs"][0]


def _runnable_event(job: dict, attempts: int = 0) -> dict:
    return {"source": "aws.batch", "detail-type": "Batch Job State Change", "time": _iso(),
            "detail": {"jobId": job["jobId"], "jobName": job["jobName"], "status": "RUNNABLE",
                       "jobQueue": job["jobQueue"], "attempts": [{}] * attempts}}


def test_a_job_still_waiting_after_the_queue_wait_bound_is_cancelled_with_the_reason(aws):
    job = _runnable_job(aws)  # e.g. queued behind other runs' jobs: never at the head long enough
    desc, visited = aws.run(aws.queue_wait_arn, "wait-1", _runnable_event(job))
    assert desc["status"] == "SUCCEEDED", desc
    assert aws.hooks.waits == [QUEUE_WAIT.to_seconds()] and visited[-2:] == ["CancelWaitingJob", "Cancelled"]
    (record,) = aws.batch.describe_jobs(jobs=[job["jobId"]])["jobs"]
    assert record["status"] == "FAILED"
    assert record["statusReason"].startswith(f"QUEUE_WAIT: RUNNABLE for {int(QUEUE_WAIT.to_minutes())} minutes")


def test_a_job_that_started_or_was_retried_during_the_wait_is_left_alone(aws):
    started = _running_train_job(aws, "run-q1")
    desc, visited = aws.run(aws.queue_wait_arn, "wait-started", _runnable_event(started))
    assert desc["status"] == "SUCCEEDED" and visited[-1] == "MovedOn"
    retried = _running_train_job(aws, "run-q2")  # its first attempt ran; the retry waits again
    batch_backends[ENV.account][REGION]._jobs[retried["jobId"]].status = "RUNNABLE"
    desc, visited = aws.run(aws.queue_wait_arn, "wait-retried", _runnable_event(retried, attempts=0))
    assert desc["status"] == "SUCCEEDED" and visited[-1] == "MovedOn"
    assert aws.batch.describe_jobs(jobs=[retried["jobId"]])["jobs"][0]["status"] == "RUNNABLE"


def test_a_run_whose_job_waits_past_the_bound_fails_with_a_notification_that_says_so(aws):
    aws.hooks.runnable_job_definitions.add("prepare")
    run = aws.sfn.start_execution(stateMachineArn=aws.pipeline_arn, name="run-queued", input=json.dumps(data()))
    deadline = time.monotonic() + 60
    while not (queued := aws.batch.list_jobs(jobQueue="single-node", jobStatus="RUNNABLE")["jobSummaryList"]):
        assert time.monotonic() < deadline, "Prepare was never submitted"
        time.sleep(0.2)
    (job,) = aws.batch.describe_jobs(jobs=[queued[0]["jobId"]])["jobs"]
    assert aws.run(aws.queue_wait_arn, "wait-run", _runnable_event(job))[0]["status"] == "SUCCEEDED"
    while (desc := aws.sfn.describe_execution(executionArn=run["executionArn"]))["status"] == "RUNNING":
        assert time.monotonic() < deadline + 60, "the run did not end"
        time.sleep(0.2)
    assert desc["status"] == "FAILED"
    (message,) = [n for n in aws.notifications() if "run-queued" in n]
    assert '"Prepare"' in message and "QUEUE_WAIT: RUNNABLE for" in message


# ---- the starter: every upload starts a run ---------------------------------------------------
def _upload_event(dataset: str, version: str) -> dict:
    return {"source": "aws.s3", "detail-type": "Object Created",
            "detail": {"bucket": {"name": DATA}, "object": {"key": f"incoming/{dataset}/{version}/_SUCCESS"}}}


def test_a_name_the_service_refuses_falls_back_to_the_hashed_name(aws):
    version = "2026-01-05-" + "x" * 80  # dataset-version is over the 80-character limit
    desc, visited = aws.run(aws.starter_arn, "evt-long", _upload_event("catalog", version))
    assert desc["status"] == "SUCCEEDED", desc
    assert visited[-2:] == ["StartPipelineHashedName", "Started"]
    (execution,) = aws.sfn.list_executions(stateMachineArn=aws.pipeline_arn)["executions"]
    digest = hashlib.md5(f"catalog/{version}".encode()).hexdigest()
    assert execution["name"] == f"upload-{digest}"


@pytest.mark.parametrize("then", ["retry succeeds", "retry refused for another reason"])
def test_a_start_whose_response_was_lost_starts_one_run_per_data_version(aws, then):
    # The first StartExecution started the run but its response never came back (a client fault,
    # retried); the retry either sees the run (ExecutionAlreadyExists, or the same response for the
    # same name and input) or is refused for a reason that is not the name: never a second run.
    aws.hooks.start_execution_faults = [("SdkClient", True)]
    if then == "retry refused for another reason":
        aws.hooks.start_execution_faults.append(("ExecutionLimitExceeded", False))
    desc, visited = aws.run(aws.starter_arn, "evt-lost", _upload_event("catalog", "v1"))
    assert "StartPipelineHashedName" not in visited
    (execution,) = aws.sfn.list_executions(stateMachineArn=aws.pipeline_arn)["executions"]
    assert execution["name"] == "catalog-v1"
    if then == "retry refused for another reason":  # the starter fails (its alarm), the run exists once
        assert desc["status"] == "FAILED" and "ExecutionLimitExceeded" in desc["error"]


def test_throttled_start_is_retried_and_the_run_starts(aws):
    aws.hooks.throttle_start_executions = 3
    desc, visited = aws.run(aws.starter_arn, "evt-busy", _upload_event("catalog", "v1"))
    assert desc["status"] == "SUCCEEDED", desc
    assert aws.hooks.throttle_start_executions == 0 and visited[-2:] == ["StartPipeline", "Started"]
    (execution,) = aws.sfn.list_executions(stateMachineArn=aws.pipeline_arn)["executions"]
    assert execution["name"] == "catalog-v1"

