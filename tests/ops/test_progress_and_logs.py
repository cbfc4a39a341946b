"""A running Train as `trainium-runs status` shows it (heartbeat metrics in CloudWatch, the planned
step count from the progress log line) and `logs --node N / --follow`, against moto."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import boto3
import pytest
from moto import mock_aws
from rich.console import Console

from pipeline_contract import (
    HEARTBEAT_LOSS_METRIC,
    HEARTBEAT_NAMESPACE,
    HEARTBEAT_RUN_DIMENSION,
    HEARTBEAT_STAGE_DIMENSION,
    HEARTBEAT_STEP_METRIC,
    HEARTBEAT_THROUGHPUT_METRIC,
)
from pipeline_ops import cli, rendering, run_reader, runs
from pipeline_ops.context import Context

REGION = "us-east-1"
GROUP = "/aws/batch/job"


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        yield


def _context(*extra: str) -> Context:
    args = cli.build_parser().parse_args(["--region", REGION, "--stage", "prod", "--offline-prices", "status", *extra])
    return Context(args)


def _put_heartbeats(run_id: str, now: float, points: list[tuple[float, int, float, float]]) -> None:
    """(seconds before now, step, loss, tokens/s) as the EMF lines would become metrics."""
    cloudwatch = boto3.client("cloudwatch", region_name=REGION)
    dims = [{"Name": HEARTBEAT_STAGE_DIMENSION, "Value": "prod"}, {"Name": HEARTBEAT_RUN_DIMENSION, "Value": run_id}]
    for ago, step, loss, tokens in points:
        ts = datetime.fromtimestamp(now - ago, UTC)
        cloudwatch.put_metric_data(Namespace=HEARTBEAT_NAMESPACE, MetricData=[
            {"MetricName": HEARTBEAT_STEP_METRIC, "Dimensions": dims, "Timestamp": ts, "Value": step},
            {"MetricName": HEARTBEAT_LOSS_METRIC, "Dimensions": dims, "Timestamp": ts, "Value": loss},
            {"MetricName": HEARTBEAT_THROUGHPUT_METRIC, "Dimensions": dims, "Timestamp": ts, "Value": tokens}])


def _log(stream: str, *messages: str) -> None:
    logs = boto3.client("logs", region_name=REGION)
    try:
        logs.create_log_group(logGroupName=GROUP)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    try:
        logs.create_log_stream(logGroupName=GROUP, logStreamName=stream)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    logs.put_log_events(logGroupName=GROUP, logStreamName=stream,
                        logEvents=[{"timestamp": int(time.time() * 1000), "message": m} for m in messages])


def test_running_train_shows_step_loss_throughput_and_eta(aws, capsys) -> None:
    now = float(int(time.time()) // 60 * 60)
    # 10 steps per minute for 4 minutes; the planned total is 100 steps.
    _put_heartbeats("run-7", now, [(240, 10, 0.90, 1000.0), (180, 20, 0.70, 1100.0), (120, 30, 0.60, 1200.0),
                                   (60, 40, 0.50, 1250.0)])
    _put_heartbeats("other-run", now, [(60, 999, 9.9, 1.0)])  # another run of the stage is not mixed in
    _log("train/default/main", "2026-01-01 INFO train step 30/100  loss=0.6  eta 06:00",
         "2026-01-01 INFO train step 40/100  loss=0.5  eta 05:00")
    record = {"jobId": "j-1", "status": "RUNNING", "startedAt": int((now - 300) * 1000),
              "container": {"logStreamName": "train/default/main"}}
    progress = run_reader.train_progress(_context(), "run-7", record, now=now)
    assert progress["step"] == 40 and progress["total_steps"] == 100
    assert progress["loss"] == pytest.approx(0.50) and progress["tokens_per_s"] == pytest.approx(1250.0)
    assert progress["steps_per_s"] == pytest.approx(10 / 60, rel=1e-3)
    assert progress["eta_seconds"] == pytest.approx(60 / (10 / 60), rel=1e-3)  # 60 steps left at 1/6 step/s
    assert progress["heartbeat_age_seconds"] == pytest.approx(60.0)
    rendering.render_progress(Console(), progress)
    assert "train: step 40/100, loss 0.5000, 1,250 tokens/s, ETA 0:06:00" in capsys.readouterr().out


def test_before_the_first_heartbeat_there_is_no_progress_and_no_log_means_no_eta(aws) -> None:
    record = {"jobId": "j-2", "status": "RUNNING", "startedAt": int(time.time() * 1000), "container": {}}
    assert run_reader.train_progress(_context(), "run-new", record) is None
    assert runs.train_progress({HEARTBEAT_STEP_METRIC: [(100.0, 5.0)]}, None, now=130.0)["eta_seconds"] is None


def test_node_job_ids_of_a_multi_node_job() -> None:
    record = {"jobId": "j", "nodeProperties": {"numNodes": 4, "mainNode": 0}}
    assert runs.node_job_id(record, None) == "j#0" and runs.node_job_id(record, 3) == "j#3"
    with pytest.raises(ValueError, match="has nodes 0..3"):
        runs.node_job_id(record, 4)
    assert runs.node_job_id({"jobId": "single"}, None) is None
