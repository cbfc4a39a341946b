"""Tracking: one MLflow run per pipeline run with a child per step, in DIR/mlruns by default;
never breaks a step (mlflow missing, backend unreachable); only rank 0 logs."""

from __future__ import annotations

import json
import logging
import sys

import pytest

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from pipeline_steps import tracking  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RANK", "AWS_BATCH_JOB_NODE_INDEX",
                 "PIPELINE_RUN_ID", "PIPELINE_TEAM", "AWS_BATCH_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracking, "_warned", False)


def _runs(run_dir):
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT)
    return client, client.search_runs([exp.experiment_id])


def test_steps_become_children_of_one_run_named_after_the_run_dir(tmp_path, monkeypatch):
    run_dir = tmp_path / "catalog-2026-01-05"
    (run_dir / "prepared").mkdir(parents=True)
    (run_dir / "prepared" / "prepare.json").write_text(json.dumps({"input_sha256": "abc123"}))
    monkeypatch.setenv("INSTANCE_TYPE", "trn1.32xlarge")
    monkeypatch.setenv("AWS_BATCH_JOB_NUM_NODES", "4")
    monkeypatch.setenv("TRAINING_IMAGE_DIGEST", "sha256:feed")
    prepare = tracking.log_step("prepare", run_dir, params={"preset": "tiny"}, metrics={"pairs.good": 90})
    train = tracking.log_step("train", run_dir, metrics={"final_loss": 0.5, "recall@10": 0.9, "skipped": None},
                              config={"train": {"lr": 0.001}},
                              history=[("loss", 1.0 / (i + 1), i) for i in range(2500)])
    assert prepare and train

    client, runs = _runs(run_dir)
    by_name = {r.info.run_name: r for r in runs}
    parent = by_name["catalog-2026-01-05"]
    assert parent.data.tags[tracking.RUN_ID_TAG] == "catalog-2026-01-05"
    for step in ("prepare", "train"):
        assert by_name[step].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert by_name[step].info.status == "FINISHED"
    params = by_name["train"].data.params
    # the reproducibility set
    assert params["data_manifest_sha256"] == "abc123" and params["instance_type"] == "trn1.32xlarge"
    assert params["num_nodes"] == "4" and params["image_digest"] == "sha256:feed"
    assert "version.torch" in params and params["config.train.lr"] == "0.001"
    assert by_name["train"].data.metrics["recall_at_10"] == 0.9
    # the loss curve is kept, thinned to a bounded number of points, last point included
    history = client.get_metric_history(train, "loss")
    assert 500 <= len(history) <= 1001 and history[-1].step == 2499


def test_default_store_is_inside_the_run_dir_and_a_second_step_finds_the_parent(tmp_path):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    tracking.log_step("prepare", run_dir)
    pointer = json.loads((run_dir / tracking.POINTER_FILE).read_text())
    assert pointer["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    tracking.log_step("sanity", run_dir)
    parent = tracking.log_pipeline(run_dir, metrics={"cost.total_usd": 0.0})
    assert parent == pointer["mlflow_run_id"]
    _, runs = _runs(run_dir)
    assert len([r for r in runs if "mlflow.parentRunId" not in r.data.tags]) == 1


def test_unreachable_backend_warns_once_and_the_step_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on port 9
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.tracking"):
        assert tracking.log_step("prepare", tmp_path) is None
        assert tracking.log_step("train", tmp_path) is None
    warnings = [r for r in caplog.records if "tracking disabled" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1:9" in warnings[0].getMessage()


def test_mlflow_not_installed_warns_and_returns(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.tracking"):
        assert tracking.log_step("prepare", tmp_path) is None
    assert "mlflow is not installed" in caplog.text
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("env,logs", [({"RANK": "1"}, False), ({"RANK": "0"}, True),
                                      ({"AWS_BATCH_JOB_NODE_INDEX": "1", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}, False),
                                      ({"AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}, True),
                                      ({}, True)])
def test_only_rank_zero_of_the_main_node_logs(env, logs):
    assert tracking.is_logging_process(env) is logs


def test_a_failed_step_leaves_a_failed_child_run_with_its_error(tmp_path, monkeypatch):
    from pipeline_steps.__main__ import main
    from pipeline_steps.errors import ExitCode

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "catalog-v9"
    run_dir.mkdir()  # a run whose prepare never ran: validate has nothing to read
    assert main(["validate", "--run-dir", str(run_dir), "--backend", "cpu"]) == ExitCode.BAD_INPUT
    _, runs = _runs(run_dir)
    failed = [r for r in runs if r.info.run_name == "validate"]
    assert len(failed) == 1 and failed[0].info.status == "FAILED"
    assert failed[0].data.params["exit_code"] == str(int(ExitCode.BAD_INPUT))
    assert failed[0].data.tags["error"].startswith("BadInputError: ") and "prepare" in failed[0].data.tags["error"]
    parent = next(r for r in runs if r.info.run_name == "catalog-v9")
    assert failed[0].data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_no_failed_run_without_a_run_dir_or_for_run_local(tmp_path, monkeypatch):
    from pipeline_steps.__main__ import main

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert main(["validate", "--run-dir", str(tmp_path / "missing"), "--backend", "cpu"]) != 0
    assert not (tmp_path / "missing").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "run-local.json").write_text('{"preset": "small", "backend": "cpu"}')
    assert main(["run-local", "--run-dir", str(other), "--preset", "tiny"]) == 78
    assert not (other / "mlruns").exists()


def test_mlflow_ui_serves_a_run_dirs_store(tmp_path, monkeypatch):
    """`mlflow ui --backend-store-uri DIR/mlruns` works from the dev install: the full `mlflow`
    package (the server) is there, and its API lists the step runs (Flask test client, no port)."""
    import os
    import subprocess

    import mlflow.server as server
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "catalog-v1"
    run_dir.mkdir()
    tracking.log_step("prepare", run_dir, metrics={"pairs.good": 90})
    store = (run_dir / "mlruns").resolve().as_uri()
    script = (
        "import json, mlflow.server as s\n"
        "c = s.app.test_client()\n"
        "assert c.get('/health').status_code == 200\n"
        "exps = c.post('/api/2.0/mlflow/experiments/search', json={'max_results': 10}).get_json()['experiments']\n"
        "ids = [e['experiment_id'] for e in exps]\n"
        "runs = c.post('/api/2.0/mlflow/runs/search', json={'experiment_ids': ids}).get_json()['runs']\n"
        "print(json.dumps(sorted(r['info']['run_name'] for r in runs)))\n")
    # what `mlflow ui --backend-store-uri` hands its server processes
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true", server.BACKEND_STORE_URI_ENV_VAR: store,
           server.ARTIFACT_ROOT_ENV_VAR: store}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["catalog-v1", "prepare"]
    cli = subprocess.run([sys.executable, "-m", "mlflow", "ui", "--help"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "--backend-store-uri" in cli.stdout


def _parent(run_dir):
    client, runs = _runs(run_dir)
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return parent


def test_a_step_failing_with_a_code_batch_does_not_retry_closes_the_pipeline_run_as_failed(tmp_path):
    """On AWS nothing runs after such a step (the state machine takes its failure path), so the
    failing step itself closes the pipeline's run; a retryable failure (75) leaves it open."""
    run_dir = tmp_path / "r-fail"
    run_dir.mkdir()
    tracking.log_step("prepare", run_dir)
    tracking.log_failure("train", run_dir, error="RetryableError: collective timed out", exit_code=75)
    assert _parent(run_dir).info.status == "RUNNING"  # Batch retries the attempt
    tracking.log_failure("train", run_dir, error="BadConfigError: checkpoint does not fit", exit_code=78)
    parent = _parent(run_dir)
    assert parent.info.status == "FAILED"
    assert parent.data.tags[tracking.FAILED_STEP_TAG] == "train" and parent.data.tags[tracking.OUTCOME_TAG] == "failed"


def test_metric_stream_shows_curves_on_a_running_child_that_the_final_log_step_completes(tmp_path):
    run_dir = tmp_path / "r-stream"
    run_dir.mkdir()
    stream = tracking.MetricStream("train", run_dir, every=5, keys=("loss", "lr"))
    for step in range(1, 13):
        stream.log(step, {"loss": 1.0 / step, "lr": 0.001, "epoch": 0, "note": "host values only"})
    client, runs = _runs(run_dir)
    (live,) = [r for r in runs if r.info.run_name == "train"]
    assert live.info.status == "RUNNING"  # visible while training runs
    assert [m.step for m in client.get_metric_history(live.info.run_id, "loss")] == [5, 10]
    assert "epoch" not in live.data.metrics

    tracking.log_step("train", run_dir, metrics={"final_loss": 0.1}, history=[("loss", 9.0, 1)])
    client, runs = _runs(run_dir)
    (done,) = [r for r in runs if r.info.run_name == "train"]  # the same run, completed
    assert done.info.run_id == live.info.run_id and done.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(done.info.run_id, "loss")] == [5, 10]


def test_metric_stream_never_fails_training_and_only_rank_0_streams(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    tracking.MetricStream("train", tmp_path, every=1, keys=("loss",)).log(1, {"loss": 1.0})
    assert not (tmp_path / "mlruns").exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on port 9
    stream = tracking.MetricStream("train", tmp_path, every=1, keys=("loss",))
    with caplog.at_level(logging.WARNING, logger="pipeline_steps.tracking"):
        for step in range(1, 4):
            stream.log(step, {"loss": 1.0})
    assert len([r for r in caplog.records if "tracking disabled" in r.getMessage()]) == 1


def test_a_step_failing_after_streaming_marks_its_streamed_run_failed(tmp_path):
    run_dir = tmp_path / "r-stream-fail"
    run_dir.mkdir()
    tracking.MetricStream("train", run_dir, every=1, keys=("loss",)).log(1, {"loss": 2.0})
    tracking.log_failure("train", run_dir, error="NonFiniteLossError: loss is nan", exit_code=80)
    _, runs = _runs(run_dir)
    (train,) = [r for r in runs if r.info.run_name == "train"]
    assert train.info.status == "FAILED" and train.data.metrics["loss"] == 2.0


def test_a_teams_run_and_its_steps_are_tagged_with_the_team(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "search" / "catalog-v1"
    run_dir.mkdir(parents=True)
    monkeypatch.setenv("PIPELINE_TEAM", "search")
    monkeypatch.setenv("PIPELINE_RUN_ID", "search/catalog-v1")  # what the entrypoint exports for a team's run
    assert tracking.log_step("prepare", run_dir, params={"preset": "tiny"})
    _, runs = _runs(run_dir)
    assert {r.info.run_name: r.data.tags[tracking.TEAM_TAG] for r in runs} == {"search/catalog-v1": "search",
                                                                               "prepare": "search"}
