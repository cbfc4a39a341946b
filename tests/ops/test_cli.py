"""trainium-runs against moto: the real (synthesized) state machine definition runs there with the
orchestration tests' Batch patch, and the CLI finds it through the stage's stack output."""

from __future__ import annotations

import functools
import json
import time
from unittest import mock

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_callback as callback_module,
)

from pipeline_contract import PIPELINE_STEPS
from pipeline_ops import cli, commands, context
from pipeline_ops.rendering import CAUSE_CHARS
from tests.infra.moto_batch import patched_moto_batch
from tests.infra.pipeline_fixtures import ENV, TEAM, synthesized
from tests.infra.pipeline_world import ARTIFACTS, DATA, PipelineWorld

REGION = ENV.region
BASE = ["--region", REGION]


class _CloudFormation:
    """DescribeStacks of the deployed stage. moto's CloudFormation needs the `moto[cloudformation]`
    extra (openapi-spec-validator), which the dev environment does not install; this stand-in
    answers with the real API's shapes, including its error for an unknown stack."""

    def __init__(self, stacks: dict[str, dict[str, str]]) -> None:
        self.stacks = stacks

    def describe_stacks(self, StackName: str) -> dict:
        if StackName not in self.stacks:
            raise ClientError({"Error": {"Code": "ValidationError",
                                         "Message": f"Stack with id {StackName} does not exist"}}, "DescribeStacks")
        outputs = [{"OutputKey": k, "OutputValue": v} for k, v in self.stacks[StackName].items()]
        return {"Stacks": [{"StackName": StackName, "Outputs": outputs}]}


@pytest.fixture(scope="module")
def world():
    """One mocked account for the module: the pipeline deployed as stack TrnEmbed-dev-Pipeline,
    a published run, a rejected run and a failed run (started through the CLI)."""
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}, "batch": {"use_docker": False}}), \
            patched_moto_batch() as hooks, \
            mock.patch.object(callback_module, "_DELAY_SECONDS_SYNC_CONDITION_CHECK", 0.05):  # faster .sync polls
        w = PipelineWorld(hooks)
        cloudformation = _CloudFormation({"TrnEmbed-dev-Pipeline": {"StateMachineArn": w.pipeline_arn},
                                          "TrnEmbed-dev-Storage": {"DataBucketName": DATA,
                                                                   "ArtifactsBucketName": ARTIFACTS}})
        real_client = context.Context.client
        patch_cfn = mock.patch.object(context.Context, "client", lambda self, name: cloudformation
                                      if name == "cloudformation" else real_client(self, name))
        patch_cfn.start()
        w.cloudformation = cloudformation
        w.put_gate("run-ok", passed=True)
        w.put_gate("run-rejected", passed=False)
        for name, extra in (("run-ok", ["--nodes", "3"]), ("run-rejected", [])):
            assert cli.main([*BASE, "start", "--data-uri", f"s3://{DATA}/incoming/catalog/v1/", "--name", name,
                             *extra]) == 0
        _wait(w, "run-ok", "run-rejected")
        hooks.fail_job_definitions.add("train")
        assert cli.main([*BASE, "start", "--data-uri", "/fsx/data/incoming/catalog/v2", "--name", "run-failed",
                         "--base-model", "run-ok"]) == 0
        _wait(w, "run-failed")
        hooks.fail_job_definitions.clear()
        yield w
        patch_cfn.stop()


def _wait(world, *names: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for name in names:
        arn = world.pipeline_arn.replace(":stateMachine:", ":execution:") + f":{name}"
        while world.sfn.describe_execution(executionArn=arn)["status"] == "RUNNING":
            assert time.monotonic() < deadline, f"{name} did not finish"
            time.sleep(0.1)


def run_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert cli.main([*BASE, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_start_sends_the_documented_input(world, capsys):
    ok = run_json(capsys, "status", "run-ok")
    assert ok["input"] == {"data_s3_uri": f"s3://{DATA}/incoming/catalog/v1/",
                           "data_uri": "/fsx/data/incoming/catalog/v1", "dataset": "catalog", "version": "v1",
                           "num_nodes": 3}
    failed = run_json(capsys, "status", "run-failed")
    assert failed["input"]["init_from"] == "/fsx/runs/run-ok"  # a bare run id means that run's dir
    by_name = {s["jobName"]: s for s in world.hooks.submitted if s["parameters"]["run_id"] == "run-ok"}
    assert by_name["train"]["nodeOverrides"] == {"numNodes": 3}
    assert by_name["prepare"]["parameters"]["data_uri"] == "/fsx/data/incoming/catalog/v1"


def test_start_experiment_names_its_share_and_itself(world, capsys):
    # One fair-share training queue: the share identifier, not a second queue, marks an experiment.
    out = run_json(capsys, "start", "--data-uri", "/fsx/data/incoming/catalog/v3", "--share", "experiments")
    assert out["run_id"].startswith("catalog-v3-")
    assert out["input"]["share"] == "experiments" and "training_queue" not in out["input"]


def test_start_sizes_the_prepare_array_job(world, capsys):
    out = run_json(capsys, "start", "--data-uri", "/fsx/data/incoming/catalog/v3", "--prepare-shards", "16",
                   "--name", "run-prepare-shards")
    assert out["input"]["prepare_shards"] == 16


def test_start_takes_a_key_of_the_stages_data_bucket_from_the_storage_stack_output(world, capsys):
    out = run_json(capsys, "start", "--data-uri", "incoming/catalog/v4/")
    assert out["input"]["data_s3_uri"] == f"s3://{DATA}/incoming/catalog/v4/"
    assert out["input"]["data_uri"] == "/fsx/data/incoming/catalog/v4" and out["input"]["version"] == "v4"


def test_buckets_come_from_the_storage_stack_outputs(world, capsys):
    out = run_json(capsys, "buckets")
    assert out["data_bucket"] == DATA and out["artifacts_bucket"] == ARTIFACTS
    assert out["upload_to"] == f"s3://{DATA}/incoming/<dataset>/<version>/"
    assert out["current_model"] == f"s3://{ARTIFACTS}/models/current.json"


def test_stop_aborts_a_running_run_and_is_a_no_op_on_a_finished_one(world, capsys):
    # moto 5.2.5 cannot abort an execution inside a .sync Batch task (its callback wait raises), so
    # the running case uses a one-state machine that waits; the finished case uses the real pipeline.
    waiting = world.sfn.create_state_machine(
        name="waits", roleArn=f"arn:aws:iam::{ENV.account}:role/sfn",
        definition=json.dumps({"StartAt": "Wait", "States": {"Wait": {"Type": "Wait", "Seconds": 600, "End": True}}}),
    )["stateMachineArn"]
    execution = world.sfn.start_execution(stateMachineArn=waiting, name="long-run")["executionArn"]
    while len(world.sfn.get_execution_history(executionArn=execution)["events"]) < 2:
        time.sleep(0.05)  # moto cannot stop an execution whose worker has not started yet
    out = run_json(capsys, "--state-machine-arn", waiting, "stop", "long-run", "--cause", "wrong data")
    assert out == {"run_id": "long-run", "stopped": True, "status": "ABORTED", "cause": "wrong data"}
    deadline = time.monotonic() + 10  # moto reflects the stop from the execution's worker thread
    while world.sfn.describe_execution(executionArn=execution)["status"] == "RUNNING":
        assert time.monotonic() < deadline, "the run was not stopped"
        time.sleep(0.1)
    assert world.sfn.describe_execution(executionArn=execution)["status"] == "ABORTED"
    assert run_json(capsys, "stop", "run-ok") == {"run_id": "run-ok", "stopped": False, "status": "SUCCEEDED"}


def test_start_with_a_taken_name_exits_6(world, capsys):
    assert cli.main([*BASE, "start", "--data-uri", "/fsx/data/x", "--name", "run-ok"]) == 6
    assert "already exists" in capsys.readouterr().err


def test_status_shows_timeline_jobs_nodes_and_cost(world, capsys):
    out = run_json(capsys, "status", "run-ok", "--price", "trn1.2xlarge=1.0")
    assert out["status"] == "SUCCEEDED" and out["end_state"] == "Done"
    assert [v["state"] for v in out["timeline"]][-5:] == ["PointerRecord", "Publish", "NotifyPublishedMessage",
                                                          "NotifyPublished", "Done"]
    jobs = {j["step"]: j for j in out["jobs"]}
    assert list(jobs) == [step.state for step in PIPELINE_STEPS]
    assert all(j["job_id"] and j["status"] == "SUCCEEDED" for j in jobs.values())
    assert jobs["Train"]["nodes"] == 3 and jobs["Train"]["instance_type"] == "trn1.32xlarge"
    assert jobs["Prepare"]["nodes"] == 1 and jobs["Prepare"]["instance_type"] == "trn1.2xlarge"
    # cost = job seconds x nodes x price, summed
    expected = sum(j["seconds"] / 3600 * j["nodes"] * (21.50 if j["instance_type"] == "trn1.32xlarge" else 1.0)
                   for j in jobs.values())
    assert out["cost"]["total_usd"] == pytest.approx(expected, abs=1e-3)
    assert out["cost"]["unpriced"] == []
    assert out["metrics"] == {"recall@10": 0.5} and out["gate_passed"] is True
    assert {v["state"]: v["outcome"] for v in out["timeline"]}["ReadCurrentModel"] == "caught"  # nothing published
    # moto has no Price List API: the committed table priced the training type, and says so
    assert jobs["Train"]["price_source"].startswith("committed table")
    assert jobs["Prepare"]["price_source"] == "override (--price)"
    assert sorted(out["cost"]["price_sources"]) == sorted({jobs["Train"]["price_source"], "override (--price)"})


def test_status_of_a_failed_run_names_the_step_job_and_reason(world, capsys):
    capsys.readouterr()
    assert cli.main([*BASE, "status", "run-failed"]) == 0
    text = capsys.readouterr().out
    assert "FAILED" in text and "failed in Train" in text
    out = run_json(capsys, "status", "run-failed")
    # the cause (the job's whole DescribeJobs record) is cut visibly, never mid-record without a word
    more = len(out["failure"]["cause"]) - CAUSE_CHARS
    assert more > 0 and f"... ({more} more characters: --json)" in " ".join(text.split())  # rich wraps lines
    assert out["failure"]["state"] == "Train" and out["failure"]["error"] == "States.TaskFailed"
    # the Fail end state failed with the run; a task whose error a Catch handled was caught
    outcomes = {v["state"]: v["outcome"] for v in out["timeline"]}
    assert (outcomes["Failed"], outcomes["DiagnoseFailure"]) == ("failed", "succeeded")
    train = next(j for j in out["jobs"] if j["step"] == "Train")
    assert out["failure"]["job_id"] == train["job_id"] and train["status"] == "FAILED"
    assert "Validate" not in [j["step"] for j in out["jobs"]]


def test_status_without_run_is_the_latest(world, capsys):
    latest = world.sfn.list_executions(stateMachineArn=world.pipeline_arn, maxResults=1)["executions"][0]
    assert run_json(capsys, "status")["run_id"] == latest["name"]


def test_runs_lists_outcomes_metrics_and_cost(world, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # rich fits tables to the terminal
    out = run_json(capsys, "runs", "--max", "10")
    by_id = {r["run_id"]: r for r in out["runs"]}
    assert by_id["run-ok"]["end_state"] == "Done" and by_id["run-ok"]["metrics"] == {"recall@10": 0.5}
    assert by_id["run-rejected"]["end_state"] == "ModelRejected" and by_id["run-rejected"]["gate_passed"] is False
    assert by_id["run-failed"]["status"] == "FAILED" and by_id["run-failed"]["failed_state"] == "Train"
    # no cited price for trn1.2xlarge: the single-node steps are flagged, not guessed
    assert "Prepare" in by_id["run-ok"]["unpriced"]
    capsys.readouterr()
    assert cli.main([*BASE, "runs"]) == 0
    table = capsys.readouterr().out
    assert "run-ok" in table and "ModelRejected" in table and "failed in Train" in table


def test_logs_prints_the_jobs_log_stream(world, capsys):
    status = run_json(capsys, "status", "run-ok")
    train_id = next(j["job_id"] for j in status["jobs"] if j["step"] == "Train")
    record = world.batch.describe_jobs(jobs=[train_id])["jobs"][0]
    stream = record["container"]["logStreamName"]
    logs = boto3.client("logs", region_name=REGION)
    try:
        logs.create_log_group(logGroupName="/aws/batch/job")
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    logs.create_log_stream(logGroupName="/aws/batch/job", logStreamName=stream)
    logs.put_log_events(logGroupName="/aws/batch/job", logStreamName=stream,
                        logEvents=[{"timestamp": int(time.time() * 1000), "message": "step 10 loss 0.42"}])
    out = run_json(capsys, "logs", "run-ok", "train")
    assert out["job_id"] == train_id and [e["message"] for e in out["events"]] == ["step 10 loss 0.42"]


@pytest.mark.parametrize("args,code,message", [
    (["status", "no-such-run"], 3, "unknown run 'no-such-run'"),
    (["logs", "run-ok", "bogus"], 2, "invalid choice: 'bogus'"),
    (["logs", "run-rejected", "embed"], 3, "has no Embed job"),
    (["--stage", "nope", "runs"], 4, "no stack TrnEmbed-nope-Pipeline"),
    (["--state-machine-arn", f"arn:aws:states:{REGION}:123456789012:stateMachine:gone", "runs"], 4, "no state machine"),
    (["status", "--price", "trn1.2xlarge"], 2, "INSTANCE_TYPE=USD_PER_HOUR"),
    # Only the stage's data bucket is linked to /fsx/data: another bucket would train on nothing.
    (["start", "--data-uri", "s3://someone-elses-bucket/incoming/catalog/v1/"], 2,
     f"is not the stage's data bucket '{DATA}'"),
    (["start", "--data-uri", "catalog/v1"], 2, "use incoming/<dataset>/<version>/"),
])
def test_clear_errors_and_exit_codes(world, capsys, args, code, message):
    capsys.readouterr()
    assert cli.main([*BASE, *args]) == code
    assert message in capsys.readouterr().err


def test_missing_credentials_exit_5(capsys, monkeypatch, tmp_path):
    # Outside moto, with no credentials anywhere: botocore's NoCredentialsError becomes a fix-it.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main([*BASE, "runs"]) == 5
    assert "no AWS credentials" in capsys.readouterr().err


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """Outside moto, with no credentials anywhere."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("args,message", [
    (["logs", "run-ok", "bogus"], "invalid choice: 'bogus'"),
    (["logs", "run-ok", "Train", "--lines", "0"], "'0' is not a whole number >= 1"),
    (["runs", "--max", "many"], "'many' is not a whole number >= 1"),
    (["logs", "run-ok", "train", "--follow", "--interval", "0"], "'0' is not a number of seconds > 0"),
    (["start", "--data-uri", "incoming/c/v1/", "--nodes", "0"], "'0' is not a whole number >= 1"),
    (["status", "--price", "trn1.2xlarge"], "INSTANCE_TYPE=USD_PER_HOUR"),
    (["statsu"], "invalid choice: 'statsu'"),
    ([], "the following arguments are required: command"),
])
def test_usage_errors_exit_2_before_any_credential_lookup(no_credentials, capsys, args, message):
    assert cli.main([*BASE, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "credentials" not in err


def test_version_and_step_names_complete(capsys):
    from pipeline_steps import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"trainium-runs {__version__} (trainium-embeddings)"


def _complete(tmp_path, module: str, line: str) -> set[str]:
    """What the shell's completion hook gets for `line` (argcomplete's protocol, file output)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "completions"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n", "COMP_LINE": line,
           "COMP_POINT": str(len(line)), "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
           "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", module], env=env, check=True, capture_output=True, timeout=60)
    return {word.strip() for word in out.read_text().split("\n") if word.strip()}


def test_shell_completion_of_commands_and_steps(tmp_path):
    assert {"start", "status", "runs", "logs", "stop", "buckets"} <= _complete(tmp_path, "pipeline_ops",
                                                                             "trainium-runs ")
    assert _complete(tmp_path, "pipeline_ops", "trainium-runs logs run-1 tr") == {"train"}
    assert _complete(tmp_path, "pipeline_steps", "pipeline-steps va") == {"validate"}


def _train_job(world, capsys) -> tuple[str, str]:
    status = run_json(capsys, "status", "run-ok")
    train_id = next(j["job_id"] for j in status["jobs"] if j["step"] == "Train")
    return train_id, world.batch.describe_jobs(jobs=[train_id])["jobs"][0]["container"]["logStreamName"]


def _put(stream: str, *messages: str, at: int | None = None) -> None:
    """Append `messages` to the job log group's `stream` (created if need be), at `at` ms (default: now)."""
    logs = boto3.client("logs", region_name=REGION)
    for create in (lambda: logs.create_log_group(logGroupName="/aws/batch/job"),
                   lambda: logs.create_log_stream(logGroupName="/aws/batch/job", logStreamName=stream)):
        try:
            create()
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
    logs.put_log_events(logGroupName="/aws/batch/job", logStreamName=stream,
                        logEvents=[{"timestamp": at or int(time.time() * 1000), "message": m} for m in messages])


def _three_nodes(real, train_id: str, node_record):
    """`real` (a DescribeJobs wrapper: (client or context, ids) -> records) as Batch answers for a
    3-node parallel job: the parent gets node properties, `<id>#N` the record node_record(N) gives."""
    def describe(source, job_ids):
        out = real(source, [j for j in job_ids if "#" not in j])
        for job_id in job_ids:
            if job_id == train_id:
                out[job_id] = {**out[job_id], "nodeProperties": {"numNodes": 3, "mainNode": 0}}
            elif job_id.startswith(train_id + "#"):
                out[job_id] = {"jobId": job_id, **node_record(job_id.rsplit("#", 1)[1])}
        return out
    return describe


def test_logs_node_reads_that_nodes_stream(world, capsys, monkeypatch):
    """A multi-node job's node N logs to the stream of its child job <id>#N (Batch MNP); moto runs
    Train single-node, so the parent record gets the node properties Batch reports for 3 nodes."""
    train_id, _ = _train_job(world, capsys)
    _put("train/default/node-2", "rank 16 ready")
    monkeypatch.setattr(commands, "describe_jobs", _three_nodes(commands.describe_jobs, train_id, lambda node: {
        "status": "SUCCEEDED", "container": {"logStreamName": f"train/default/node-{node}"}}))
    out = run_json(capsys, "logs", "run-ok", "train", "--node", "2")
    assert out["job_id"] == f"{train_id}#2" and [e["message"] for e in out["events"]] == ["rank 16 ready"]
    assert cli.main([*BASE, "logs", "run-ok", "train", "--node", "3"]) == 2
    assert "has nodes 0..2" in capsys.readouterr().err


def test_logs_node_of_a_single_node_job_is_a_usage_error(world, capsys):
    assert cli.main([*BASE, "logs", "run-ok", "prepare", "--node", "1"]) == 2
    assert "single-node job; drop --node" in capsys.readouterr().err


def test_logs_follow_prints_new_lines_until_the_job_ends(world, capsys, monkeypatch):
    train_id, stream = _train_job(world, capsys)
    _put(stream, "before follow")
    statuses = iter(["RUNNING", "RUNNING", "SUCCEEDED"])  # as DescribeJobs reports it on each poll
    real = commands.describe_jobs
    monkeypatch.setattr(commands, "describe_jobs", lambda ctx, ids: {
        k: ({**v, "status": next(statuses, "SUCCEEDED")} if k == train_id else v) for k, v in real(ctx, ids).items()})
    arrivals = iter([["step 20 loss 0.40"], ["step 30 loss 0.35", "done"]])  # written while we wait

    def wait(_seconds):
        messages = next(arrivals, [])
        if messages:
            _put(stream, *messages)

    monkeypatch.setattr(commands, "follow", functools.partial(commands.follow, sleep=wait))
    capsys.readouterr()
    assert cli.main([*BASE, "logs", "run-ok", "train", "--follow", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    lines = [ln.split("  ", 1)[1] for ln in out.splitlines() if "  " in ln and ln[:4].isdigit()]
    assert lines[-4:] == ["before follow", "step 20 loss 0.40", "step 30 loss 0.35", "done"]
    assert f"job {train_id} ended: SUCCEEDED" in out


# ---- why: the failed run's class, evidence and fix, from every node's log ---------------------------
def _failed_train_job(world, capsys) -> tuple[str, str]:
    status = run_json(capsys, "status", "run-failed")
    train_id = next(j["job_id"] for j in status["jobs"] if j["step"] == "Train")
    return train_id, world.batch.describe_jobs(jobs=[train_id])["jobs"][0]["container"]["logStreamName"]


def test_why_classifies_a_failed_run_from_its_log_and_defaults_to_the_latest(world, capsys):
    train_id, stream = _failed_train_job(world, capsys)
    _put(stream, "2026-11-24T03:05:40 INFO pipeline_steps.progress: train step 900/2000  loss=2.01",
         "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")
    # Without RUN: the newest failed execution (another test's run may have failed since run-failed).
    latest_failed = world.sfn.list_executions(stateMachineArn=world.pipeline_arn, statusFilter="FAILED",
                                              maxResults=1)["executions"][0]["name"]
    assert run_json(capsys, "why")["run_id"] == latest_failed
    out = run_json(capsys, "why", "run-failed")
    assert out["status"] == "FAILED"
    d = out["diagnosis"]
    assert (d["class"], d["retryable"], d["step"], d["job_id"], d["node"]) == (
        "collective_failure", True, "Train", train_id, "main")
    assert d["evidence"][0]["line"] == 2 and d["evidence"][0]["node"] == "main" and d["docs"].startswith("https://")
    assert cli.main([*BASE, "why", "run-failed"]) == 0
    text = capsys.readouterr().out
    assert "run run-failed FAILED. Failed step: Train" in text and "Class: collective_failure" in text
    assert "[main line 2] torch.distributed.DistBackendError" in text and "Suggestion: " in text


def test_why_reads_every_node_and_names_the_first_error(world, capsys, monkeypatch):
    """Multi-node: moto runs Train single-node, so the record gets the node properties Batch reports
    for 3 nodes and each node job its own stream; the cause on node 2 beats node 0's lost peer."""
    from pipeline_steps.diagnosis import job_logs

    train_id, _ = _failed_train_job(world, capsys)
    now = int(time.time() * 1000)
    _put("train/default/why-node-0", "RuntimeError: [c10d] a peer of rank 0 of 48 went away", at=now - 5000)
    _put("train/default/why-node-1", "step 900", at=now)
    _put("train/default/why-node-2", "OSError: [Errno 28] No space left on device: '/fsx/runs/run-failed/ckpt'", at=now)
    monkeypatch.setattr(job_logs, "describe_jobs", _three_nodes(job_logs.describe_jobs, train_id, lambda node: {
        "status": "FAILED", "container": {"logStreamName": f"train/default/why-node-{node}",
                                          "exitCode": 1 if node == "2" else 0}}))
    d = run_json(capsys, "why", "run-failed")["diagnosis"]
    assert (d["class"], d["node"], d["retryable"]) == ("storage_error", "node 2", False)
    assert d["evidence"][0]["node"] == "node 2" and "No space left on device" in d["evidence"][0]["text"]


def test_why_of_an_array_job_reads_its_failed_children(world, capsys):
    world.put_gate("run-embed-failed", passed=True)
    world.hooks.fail_job_definitions.add("embed")
    try:
        assert cli.main([*BASE, "start", "--data-uri", "/fsx/data/incoming/catalog/v3", "--name",
                         "run-embed-failed", "--embed-shards", "2"]) == 0
        _wait(world, "run-embed-failed")
    finally:
        world.hooks.fail_job_definitions.clear()
    status = run_json(capsys, "status", "run-embed-failed")
    embed_id = next(j["job_id"] for j in status["jobs"] if j["step"] == "Embed")
    children = world.batch.list_jobs(arrayJobId=embed_id, jobStatus="FAILED")["jobSummaryList"]
    assert children
    for child in children:
        stream = world.batch.describe_jobs(jobs=[child["jobId"]])["jobs"][0]["container"]["logStreamName"]
        _put(stream, "pyarrow.lib.ArrowIOError: [Errno 5] Input/output error")
    d = run_json(capsys, "why", "run-embed-failed")["diagnosis"]
    assert (d["class"], d["step"], d["job_id"]) == ("storage_error", "Embed", embed_id)
    assert d["node"].startswith("index ")


def test_why_of_a_run_that_did_not_fail_says_so(world, capsys):
    assert run_json(capsys, "why", "run-ok") == {"run_id": "run-ok", "status": "SUCCEEDED", "diagnosis": None}
    assert cli.main([*BASE, "why", "run-ok"]) == 0
    assert "nothing to diagnose" in capsys.readouterr().out


# ---- a stage with teams: every command acts on one team's pipeline --------------------------------
@pytest.fixture(scope="module")
def search(world):
    """Team search's pipeline beside the default one (the stand-in stage's, synthesized with the
    team), its job definitions, an upload, and one published run started through the CLI."""
    syn = synthesized(TEAM)
    for step in (s.name for s in PIPELINE_STEPS):
        world.batch.register_job_definition(jobDefinitionName=f"search-{step}", type="container",
                                            containerProperties={"image": "busybox", "vcpus": 1, "memory": 128,
                                                                 "command": ["true"]})
    arn = world.sfn.create_state_machine(name="search-pipeline", roleArn=f"arn:aws:iam::{ENV.account}:role/sfn",
                                         definition=json.dumps(syn.definition("SearchTrainingPipeline", world.values))
                                         )["stateMachineArn"]
    world.cloudformation.stacks["TrnEmbed-dev-Pipeline"]["SearchStateMachineArn"] = arn
    for key in ("pairs/part-0.jsonl", "_SUCCESS"):
        world.s3.put_object(Bucket=DATA, Key=f"incoming/search/catalog/v1/{key}", Body=b"{}")
    world.put_gate("search/run-team", passed=True)
    assert cli.main([*BASE, "--team", "search", "start", "--data-uri", "incoming/search/catalog/v1/",
                     "--name", "run-team"]) == 0
    world.pipeline_arn, default_arn = arn, world.pipeline_arn  # _wait reads the team's executions
    _wait(world, "run-team")
    world.pipeline_arn = default_arn
    return arn


def test_a_teams_run_runs_in_its_paths_with_its_share_and_tag_and_publishes_its_own_pointer(world, search, capsys):
    out = run_json(capsys, "--team", "search", "status", "run-team")
    assert out["status"] == "SUCCEEDED" and out["team"] == "search"
    assert out["input"]["data_uri"] == "/fsx/data/incoming/search/catalog/v1" and out["input"]["version"] == "v1"
    jobs = [s for s in world.hooks.submitted if s["parameters"]["run_id"] == "search/run-team"]
    assert {job["jobDefinition"] for job in jobs} == {f"search-{step.name}" for step in PIPELINE_STEPS}
    assert {job["shareIdentifier"] for job in jobs} == {"search"}
    assert all(job["tags"] == {"pipeline": "Pipeline", "team": "search"} for job in jobs)
    pointer = json.loads(world.s3.get_object(Bucket=ARTIFACTS, Key="models/search/current.json")["Body"].read())
    assert pointer["run_id"] == "search/run-team" and pointer["checkpoint"] == "/fsx/runs/search/run-team"
    assert "models/search/current.json" in " ".join(world.notifications())


def test_a_team_cannot_start_a_run_on_another_teams_data_or_share(world, search, capsys):
    assert cli.main([*BASE, "--team", "search", "start", "--data-uri", "incoming/ads/catalog/v1/"]) == 2
    assert "use incoming/search/<dataset>/<version>/" in capsys.readouterr().err
    assert cli.main([*BASE, "--team", "search", "start", "--data-uri", "/fsx/data/incoming/catalog/v1"]) == 2
    assert "is not team search's data" in capsys.readouterr().err
    assert cli.main([*BASE, "--team", "search", "start", "--data-uri", "incoming/search/catalog/v1/",
                     "--share", "production"]) == 2
    assert "its own share identifier 'search'" in capsys.readouterr().err


def test_the_pipeline_refuses_a_teams_run_on_another_teams_paths(world, search):
    # Starting the execution directly (as the admin could): the input checks keep the team in its paths.
    desc, visited = world.run(search, "run-team-escape", {
        "dataset": "catalog", "version": "v1", "data_uri": "/fsx/data/incoming/catalog/v1",
        "init_from": "/fsx/runs/search/../ads/catalog-v1", "share": "production"})
    assert desc["status"] == "FAILED" and "InvalidInput" in visited
    text = " ".join(world.notifications())
    for fix in ("data_uri: the upload directory /fsx/data/incoming/search/", "init_from: a run directory "
                "/fsx/runs/search/<run id>", "share: one of the fair-share identifiers of the training queue (search)"):
        assert fix in text


def test_an_unknown_team_is_a_stage_error_that_names_the_teams(world, search, capsys):
    assert cli.main([*BASE, "--team", "ads", "runs"]) == 4
    assert "no pipeline for team 'ads': its teams are search" in capsys.readouterr().err


def test_buckets_and_cost_per_team(world, search, capsys):
    out = run_json(capsys, "--team", "search", "buckets")
    assert out["upload_to"] == f"s3://{DATA}/incoming/search/<dataset>/<version>/"
    assert out["current_model"] == f"s3://{ARTIFACTS}/models/search/current.json"
    cost = run_json(capsys, "--offline-prices", "cost", "--max", "50")
    by_team = {row["team"]: row for row in cost["teams"]}
    assert set(by_team) == {"default", "search"}
    assert by_team["search"]["runs"] == len(world.sfn.list_executions(stateMachineArn=search)["executions"])
    assert by_team["default"]["runs"] >= 3  # run-ok, run-rejected, run-failed and the other tests' runs
    only = run_json(capsys, "--offline-prices", "--team", "search", "cost")
    assert [row["team"] for row in only["teams"]] == ["search"]
