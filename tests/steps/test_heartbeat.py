"""Heartbeat lines are valid CloudWatch EMF with the names the alarms use, and silent off Batch."""

from __future__ import annotations

import io
import json
import math

import pytest

from pipeline_contract import HEARTBEAT_NAMESPACE, HEARTBEAT_RUN_DIMENSION, HEARTBEAT_STAGE_DIMENSION
from pipeline_steps import heartbeat
from pipeline_steps.heartbeat import Heartbeat, emf_record, enabled_by_env

BATCH_ENV = {"AWS_BATCH_JOB_ID": "0b1c2d3e#1", "PIPELINE_STAGE": "prod", "PIPELINE_RUN_ID": "run-42"}


def assert_valid_emf(record: dict) -> None:
    """The EMF specification's rules that CloudWatch enforces when it extracts metrics."""
    meta = record["_aws"]
    assert isinstance(meta["Timestamp"], int) and meta["Timestamp"] > 1_600_000_000_000  # epoch ms
    for directive in meta["CloudWatchMetrics"]:
        assert isinstance(directive["Namespace"], str) and directive["Namespace"]
        for dimension_set in directive["Dimensions"]:
            assert 1 <= len(dimension_set) <= 30
            for key in dimension_set:
                assert isinstance(record[key], str), f"dimension {key} must be a string member"
        assert 1 <= len(directive["Metrics"]) <= 100
        for metric in directive["Metrics"]:
            value = record[metric["Name"]]
            assert isinstance(value, (int, float)) and math.isfinite(value), metric


def emit_one(env: dict, **kwargs) -> tuple[str | None, str]:
    stream = io.StringIO()
    line = Heartbeat(environ=env, stream=stream).emit(**kwargs)
    return line, stream.getvalue()


def test_one_valid_emf_line_per_call_with_the_documented_names():
    stream = io.StringIO()
    beat = Heartbeat(environ=BATCH_ENV, stream=stream)
    beat.emit(step=120, loss=0.41, tokens_per_s=183000.0, epoch=1)
    beat.emit(step=121, loss=0.40, tokens_per_s=182000.0)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    assert_valid_emf(record)
    (directive,) = record["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == "TrainiumEmbeddings"
    # Per stage and per run: the per-job stall alarm reads the ["Stage", "RunId"] series.
    assert directive["Dimensions"] == [["Stage"], ["Stage", "RunId"]]
    assert directive["Metrics"] == [
        {"Name": "TrainStep", "Unit": "Count"},
        {"Name": "TrainLoss", "Unit": "None"},
        {"Name": "TokensPerSecond", "Unit": "Count/Second"},
    ]
    assert record["Stage"] == "prod" and record["RunId"] == "run-42" and record["epoch"] == 1
    assert (record["TrainStep"], record["TrainLoss"], record["TokensPerSecond"]) == (120, 0.41, 183000.0)
    assert lines[0].isascii()


def test_module_constants_match_the_contract():
    assert HEARTBEAT_NAMESPACE == "TrainiumEmbeddings"
    assert HEARTBEAT_STAGE_DIMENSION == "Stage"
    assert HEARTBEAT_RUN_DIMENSION == "RunId"
    assert heartbeat.DIMENSION_SETS == (("Stage",), ("Stage", "RunId"))
    assert [name for name, _ in heartbeat.METRICS] == ["TrainStep", "TrainLoss", "TokensPerSecond"]


def test_silent_when_not_on_batch(capsys):
    line, written = emit_one({}, step=1, loss=1.0, tokens_per_s=10.0)
    assert line is None and written == ""
    Heartbeat(environ={}).emit(step=1)  # default stream: stdout
    assert capsys.readouterr().out == ""


def test_writes_to_stdout_on_batch(capsys):
    Heartbeat(environ=BATCH_ENV).emit(step=7, loss=0.5)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and json.loads(out[0])["TrainStep"] == 7


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"AWS_BATCH_JOB_ID": "abc"}, True),
    ({"AWS_BATCH_JOB_ID": "abc", "PIPELINE_HEARTBEAT": "0"}, False),
    ({"PIPELINE_HEARTBEAT": "1"}, True),
    ({"PIPELINE_HEARTBEAT": "true"}, True),
])
def test_enabled_only_on_batch_unless_forced(env, expected):
    assert enabled_by_env(env) is expected


def test_forced_on_locally_with_default_stage_and_run_id():
    stream = io.StringIO()
    Heartbeat(enabled=True, environ={}, stream=stream).emit(step=3)
    record = json.loads(stream.getvalue())
    assert record["Stage"] == "local" and record["RunId"] == "local"
    assert [m["Name"] for m in record["_aws"]["CloudWatchMetrics"][0]["Metrics"]] == ["TrainStep"]
    assert_valid_emf(record)


def test_non_finite_loss_is_left_out_of_the_metrics_but_visible():
    _, written = emit_one(BATCH_ENV, step=9, loss=float("nan"), tokens_per_s=100.0)
    record = json.loads(written)  # strict JSON: no NaN literal
    assert_valid_emf(record)
    names = [m["Name"] for m in record["_aws"]["CloudWatchMetrics"][0]["Metrics"]]
    assert names == ["TrainStep", "TokensPerSecond"]
    assert "TrainLoss" not in record and record["TrainLossNotFinite"] == "nan"


def test_extra_properties_cannot_overwrite_metrics():
    with pytest.raises(ValueError, match="TrainLoss"):
        emf_record(stage="s", run_id="r", step=1, properties={"TrainLoss": 3})


def test_run_id_dimension_comes_from_the_environment_the_entrypoint_sets():
    """RunId is a dimension value (a string member), so the per-run series exists for the alarm."""
    line, _ = emit_one({**BATCH_ENV, "PIPELINE_RUN_ID": "exec-2026-01-01"}, step=3)
    record = json.loads(line)
    assert_valid_emf(record)
    assert record["RunId"] == "exec-2026-01-01"
    assert ["Stage", "RunId"] in record["_aws"]["CloudWatchMetrics"][0]["Dimensions"]


def test_run_id_cannot_be_overwritten_by_a_property():
    with pytest.raises(ValueError, match="RunId"):
        emf_record(stage="s", run_id="r", step=1, properties={"RunId": "other"})
