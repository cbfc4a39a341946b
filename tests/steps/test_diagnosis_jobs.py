"""A failed Batch job -> its nodes' logs -> a diagnosis (pipeline_steps/diagnosis/job_logs.py), and
the pipeline's classifier function (handler.py), against stand-in Batch and CloudWatch Logs clients
with the real APIs' shapes. The moto runs of the same code: tests/infra/test_pipeline_execution.py
(the failure path) and tests/ops/test_cli.py (`trainium-runs why`)."""

from __future__ import annotations

import json

import pytest

from pipeline_steps.diagnosis import handler, job_logs
from pipeline_steps.diagnosis.classifier import MAX_EVIDENCE
from pipeline_steps.diagnosis.handler import CHAT_DESCRIPTION_CHARS
from tests.chatbot_notification import custom_notification_content


class _NotFound(Exception):
    pass


class FakeLogs:
    class exceptions:  # noqa: N801 -- boto3's attribute name
        ResourceNotFoundException = _NotFound

    def __init__(self, streams: dict[str, list[tuple[int, str]]]) -> None:
        self.streams = streams
        self.calls: list[dict] = []

    def get_log_events(self, **kwargs) -> dict:
        self.calls.append(kwargs)
        if kwargs["logStreamName"] not in self.streams:
            raise _NotFound(kwargs["logStreamName"])
        events = self.streams[kwargs["logStreamName"]][-kwargs["limit"]:]
        return {"events": [{"timestamp": t, "message": m} for t, m in events]}


class FakeBatch:
    def __init__(self, jobs: dict[str, dict], failed_children: dict[str, list[dict]] | None = None) -> None:
        self.jobs = jobs
        self.failed_children = failed_children or {}
        self.described: list[list[str]] = []

    def describe_jobs(self, jobs: list[str]) -> dict:
        assert len(jobs) <= 100
        self.described.append(jobs)
        return {"jobs": [self.jobs[j] for j in jobs if j in self.jobs]}

    def get_paginator(self, name: str):
        assert name == "list_jobs"
        batch = self

        class Pages:
            def paginate(self, arrayJobId: str, jobStatus: str):  # noqa: N803 -- the API's names
                assert jobStatus == "FAILED"
                return [{"jobSummaryList": batch.failed_children.get(arrayJobId, [])}]

        return Pages()


def _node(job_id: str, stream: str, exit_code: int = 0, **extra) -> dict:
    return {"jobId": job_id, "container": {"logStreamName": stream, "exitCode": exit_code,
                                           "logConfiguration": {"options": {"awslogs-group": "/jobs"}}}, **extra}


def test_a_multi_node_job_is_read_on_every_node_main_node_first_and_the_first_cause_named() -> None:
    parent = {"jobId": "j", "status": "FAILED", "statusReason": "Essential container in task exited",
              "nodeProperties": {"numNodes": 3, "mainNode": 1}}
    batch = FakeBatch({"j": parent, "j#0": _node("j#0", "s0"), "j#1": _node("j#1", "s1", 75),
                       "j#2": _node("j#2", "s2", 1)})
    logs = FakeLogs({"s0": [(1000, "step 900"), (5000, "RuntimeError: [c10d] a peer of rank 0 of 48 went away")],
                     "s1": [(6000, "RuntimeError: [c10d] a peer of rank 16 of 48 went away")],
                     "s2": [(3000, "ERROR TDRV:tdrv_init Uncorrectable HBM memory error is detected\nmore")]})
    result = job_logs.diagnose_job(batch, logs, "j")
    assert [s["node"] for s in result.streams] == ["node 1", "node 0", "node 2"]
    assert {c["logGroupName"] for c in logs.calls} == {"/jobs"}
    assert all(c["startFromHead"] is False and c["limit"] == job_logs.TAIL_EVENTS for c in logs.calls)
    d = result.diagnosis
    assert (d.cls, d.node, d.evidence[0].line, d.evidence[0].time) == ("device_unavailable", "node 2", 1, 3.0)
    assert result.exit_code == 75 and result.status_reason == "Essential container in task exited"


def test_an_array_job_is_read_on_its_failed_children_in_index_order() -> None:
    children = [{"jobId": f"a:{i}", "arrayProperties": {"index": i}} for i in (7, 2)]
    batch = FakeBatch({"a": {"jobId": "a", "arrayProperties": {"size": 8}},
                       "a:2": _node("a:2", "c2", 1), "a:7": _node("a:7", "c7", 1)}, {"a": children})
    logs = FakeLogs({"c2": [(1, "ok")], "c7": [(1, "ModuleNotFoundError: No module named 'pyarrow'")]})
    result = job_logs.diagnose_job(batch, logs, "a")
    assert [s["node"] for s in result.streams] == ["index 2", "index 7"]
    assert (result.diagnosis.cls, result.diagnosis.node) == ("user_code_error", "index 7")


def test_a_node_without_a_stream_or_with_an_expired_one_reads_as_empty() -> None:
    batch = FakeBatch({"j": {"jobId": "j", "status": "FAILED", "container": {"exitCode": 137,
                             "reason": "OutOfMemoryError: Container killed due to memory usage"},
                             "attempts": [{"container": {"logStreamName": "gone"}}]}})
    result = job_logs.diagnose_job(batch, FakeLogs({}), "j")
    assert result.streams[0]["log_stream"] == "gone" and result.streams[0]["lines"] == 0
    assert (result.diagnosis.cls, result.exit_code) == ("host_oom", 137)
    assert result.diagnosis.evidence[0].node == "status reason"
    with pytest.raises(LookupError, match="no job nope"):
        job_logs.diagnose_job(batch, FakeLogs({}), "nope")


def test_jobs_are_described_100_at_a_time() -> None:
    parent = {"jobId": "big", "nodeProperties": {"numNodes": 150, "mainNode": 0}}
    batch = FakeBatch({"big": parent, **{f"big#{i}": _node(f"big#{i}", f"s{i}") for i in range(150)}})
    job_logs.diagnose_job(batch, FakeLogs({}), "big")
    assert [len(ids) for ids in batch.described] == [1, 100, 50]


# ---- the classifier function -------------------------------------------------------------------
def _batch_failure(record: dict) -> dict:
    return {"run_id": "run-7", "failure": {"Train": {"Error": "States.TaskFailed", "Cause": json.dumps(record)}}}


def test_the_function_classifies_a_failed_job_from_its_logs() -> None:
    batch = FakeBatch({"j": _node("j", "s", 1, status="FAILED")})
    logs = FakeLogs({"s": [(1, "2026-01-01T00:00:01Z ERROR x: No space left on device")]})
    # The Cause is Step Functions' DescribeJobs record: PascalCase, as the .sync integration sends it.
    result = handler.classify_failure(_batch_failure({"JobId": "j", "Status": "FAILED"}), batch, logs)
    assert (result["class"], result["step"], result["job_id"], result["node"]) == ("storage_error", "Train", "j", "main")
    assert result["subject"] == "Run run-7 failed in Train: storage_error"
    assert result["text"].startswith("Failed step: Train (job j)\nClass: storage_error (a retry will not help).")
    assert "[main line 1] 2026-01-01T00:00:01Z ERROR x: No space left on device" in result["text"]


def _chat_notification(result: dict) -> dict:
    """What the failure path posts to Slack (stacks/constructs/notifications.py)."""
    content = {"textType": "client-markdown", "title": result["subject"], **result["chat"]}
    return custom_notification_content({"version": "1.0", "source": "custom", "content": content})


def test_the_chat_shows_class_step_node_evidence_and_the_fix() -> None:
    batch = FakeBatch({"j": _node("j", "s", 1, status="FAILED")})
    logs = FakeLogs({"s": [(1, "step 5 loss=2.0"), (2, "2026-01-01T00:00:01Z ERROR x: No space left on device")]})
    result = handler.classify_failure(_batch_failure({"JobId": "j", "Status": "FAILED"}), batch, logs)
    chat = _chat_notification(result)
    assert chat["description"] == (
        "*Failed step:* Train (job j)\n*Class:* `storage_error` (a retry will not help). " + result["summary"] +
        "\n*First error on:* main\n*Evidence:*\n```\n[main line 2] 2026-01-01T00:00:01Z ERROR x: No space left "
        "on device\n```")
    assert chat["nextSteps"] == [result["suggestion"], f"Docs: {result['docs']}",
                                 "`trainium-runs why run-7`: the same diagnosis, from the job's logs"]
    assert chat["keywords"] == ["storage_error", "Train"]


def test_a_class_the_log_model_gave_says_so_in_the_mail_and_the_chat() -> None:
    # the corpus's ronin-51 case: a checkpoint that cannot be written, in words no rule has
    batch = FakeBatch({"j": _node("j", "s", 1, status="FAILED")})
    logs = FakeLogs({"s": [(1, "    super(_open_zipfile_writer_file, self).__init__(torch._C.PyTorchFileWriter(str(name)))"),
                           (2, "RuntimeError: File my_out/checkpoints/checkpoint_0.pt cannot be opened.")]})
    result = handler.classify_failure(_batch_failure({"JobId": "j", "Status": "FAILED"}), batch, logs)
    assert (result["class"], result["decided_by"]) == ("storage_error", "log model")
    assert "\nDecided by: the log model, probability 0." in result["text"]
    assert "\n*Decided by:* the log model, probability 0." in _chat_notification(result)["description"]


def test_the_chat_stays_within_a_slack_section_however_long_the_evidence() -> None:
    # The most evidence the classifier keeps, each line at its longest, from a state name at
    # Step Functions' 80-character limit.
    lines = [(i, f"2026-01-01T00:00:0{i}Z ERROR x: No space left on device {'x' * 2000}") for i in range(9)]
    batch = FakeBatch({"j": _node("j", "s", 1, status="FAILED")})
    event = {"run_id": "r" * 80, "failure": {"S" * 80: {"Error": "States.TaskFailed",
                                                       "Cause": json.dumps({"JobId": "j"})}}}
    result = handler.classify_failure(event, batch, FakeLogs({"s": lines}))
    assert len(result["evidence"]) == MAX_EVIDENCE
    assert len(_chat_notification(result)["description"]) > CHAT_DESCRIPTION_CHARS // 2


def test_a_job_batch_no_longer_knows_is_classified_from_the_cause() -> None:
    cause = {"JobId": "old", "StatusReason": "Host EC2 (instance i-1) terminated.", "Container": {"ExitCode": 137}}
    result = handler.classify_failure(_batch_failure(cause), FakeBatch({}), FakeLogs({}))
    assert result["class"] == "capacity_or_infrastructure" and result["retryable"]
    assert "Note: the job's logs could not be read (LookupError" in result["text"]
    assert "*Note:* the job's logs could not be read (LookupError" in _chat_notification(result)["description"]


def test_a_cause_cut_short_still_names_the_job() -> None:
    batch = FakeBatch({"j": _node("j", "s", 80)})
    cut = json.dumps({"JobId": "j", "Attempts": [{"Container": {"LogStreamName": "s" * 40000}}]})[:32768]
    event = {"run_id": "r", "failure": {"Train": {"Error": "States.TaskFailed", "Cause": cut}}}
    result = handler.classify_failure(event, batch, FakeLogs({"s": [(1, "training")]}))
    assert (result["job_id"], result["class"]) == ("j", "nan_loss")  # exit 80, from the job's record


@pytest.mark.parametrize("error, cause, cls", [
    ("InvalidInput", "The execution input has problems, fix them and start the run again: priority: ...",
     "bad_config"),
    ("MalformedDocument", "runs/r/validation/gate.json needs a boolean passed and a metrics object; got: {}",
     "bad_input"),
    ("States.Timeout", "", "unknown"),
])
def test_failures_outside_a_job_are_classified_from_error_and_cause(error: str, cause: str, cls: str) -> None:
    event = {"run_id": "r", "failure": {"SomeState": {"Error": error, "Cause": cause}}}
    result = handler.classify_failure(event, FakeBatch({}), FakeLogs({}))
    assert (result["class"], result["step"], result["job_id"]) == (cls, "SomeState", None)


def test_an_event_without_a_failure_is_still_answered() -> None:
    result = handler.classify_failure({}, FakeBatch({}), FakeLogs({}))
    assert result["class"] == "unknown" and result["subject"] == "Run ? failed in None: unknown"


def test_the_subject_is_ascii_and_at_most_100_characters() -> None:
    event = {"run_id": "r" * 90 + "\u00e9", "failure": {"Train": {"Error": "x", "Cause": "y"}}}
    subject = handler.classify_failure(event, FakeBatch({}), FakeLogs({}))["subject"]
    assert subject.isascii() and len(subject) == 100 and "\n" not in subject


def test_the_metric_line_is_embedded_metric_format_with_stage_and_class() -> None:
    result = {"class": "host_oom", "step": "Train", "job_id": "j", "node": "node 3", "retryable": False}
    line = json.loads(handler.metric_line(result, namespace="NS", stage="prod", now=12.5))
    assert line["_aws"] == {"Timestamp": 12500, "CloudWatchMetrics": [{
        "Namespace": "NS", "Dimensions": [["Stage", "Class"]], "Metrics": [{"Name": "PipelineFailures", "Unit": "Count"}]}]}
    assert (line["Stage"], line["Class"], line["PipelineFailures"], line["node"]) == ("prod", "host_oom", 1, "node 3")


def test_the_handler_returns_the_diagnosis_and_prints_one_metric_record(monkeypatch, capsys) -> None:
    import boto3

    clients = {"batch": FakeBatch({"j": _node("j", "s", 137)}), "logs": FakeLogs({"s": [(1, "Killed")]})}
    monkeypatch.setattr(boto3, "client", lambda name: clients[name])
    monkeypatch.setenv("METRIC_NAMESPACE", "NS")
    monkeypatch.setenv("STAGE", "prod")
    result = handler.handler(_batch_failure({"JobId": "j"}))
    assert (result["class"], result["node"]) == ("host_oom", "main")
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert (record["Class"], record["Stage"], record["_aws"]["CloudWatchMetrics"][0]["Namespace"]) == \
        ("host_oom", "prod", "NS")
