"""The train step as users run it: DDP under torchrun, XLA on CPU, kill + resume, incremental training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline_steps import checkpoint
from pipeline_steps.data import train_tokenizer
from pipeline_steps.errors import ExitCode
from pipeline_steps.fileio import read_json

from .conftest import REPO, cli_env, run_cli

TRAIN = ("train", "--preset", "tiny", "--no-progress")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(checkpoint.latest(run_dir))["model"]


def test_two_process_gloo_ddp_training_learns_and_checkpoints(tiny_run: Path) -> None:
    result = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_json(tiny_run / "train" / "summary.json")
    assert summary["world_size"] == 2
    assert summary["steps"] == summary["total_steps"] > 0
    rows = metrics(tiny_run)
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert checkpoint.step_of(checkpoint.latest(tiny_run)) == summary["steps"]


def test_xla_training_compiles_nothing_after_warmup(tiny_run: Path) -> None:
    # Two epochs with a checkpoint every 7 steps: the run crosses an epoch boundary, padded last
    # batches and several checkpoint steps after warm-up; none of them may trace a new graph.
    result = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "xla", "--checkpoint-every", "7", "--epochs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    xla = read_json(tiny_run / "train" / "xla.json")
    assert xla["graphs_compiled"] > 0
    assert xla["compiles_after_warmup"] == 0, xla
    assert xla["warmup_steps"] <= 10
    summary = read_json(tiny_run / "train" / "summary.json")
    assert summary["steps"] > 2 * xla["warmup_steps"]
    assert len({tuple(s["doc_ids"]) for s in xla["batch_shapes"]}) == len(xla["batch_shapes"])


def test_sigkilled_run_resumes_to_the_same_weights(tiny_run: Path, tmp_path: Path) -> None:
    steps = ["--max-steps", "80", "--checkpoint-every", "4", "--backend", "cpu"]
    reference = tmp_path / "reference"
    shutil.copytree(tiny_run, reference)
    assert run_cli(*TRAIN, "--run-dir", reference, *steps).returncode == 0

    cmd = [sys.executable, "-m", "pipeline_steps", *TRAIN, "--run-dir", str(tiny_run), *steps]
    proc = subprocess.Popen(cmd, env=cli_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            latest = checkpoint.latest(tiny_run)
            if latest is not None and checkpoint.step_of(latest) >= 8:
                os.kill(proc.pid, signal.SIGSTOP)  # freeze it mid-training, then kill it for real
                break
            time.sleep(0.01)
        killed_at = checkpoint.step_of(checkpoint.latest(tiny_run))
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert killed_at < 80, "the run finished before it could be killed; the test proved nothing"

    resumed = run_cli(*TRAIN, "--run-dir", tiny_run, *steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    expected, actual = final_weights(reference), final_weights(tiny_run)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after resume"


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tiny_run: Path) -> None:
    assert run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", "--max-steps", "8",
                   "--checkpoint-every", "4").returncode == 0
    latest = checkpoint.latest(tiny_run)
    assert checkpoint.step_of(latest) == 8
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a truncated write

    result = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", "--max-steps", "10", "--checkpoint-every", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step-000000008" in result.stderr and "WARNING" in result.stderr
    assert "resuming from" in result.stderr and "(step 4," in result.stderr
    assert checkpoint.step_of(checkpoint.latest(tiny_run)) == 10


def test_incremental_training_keeps_the_tokenizer_and_starts_from_the_previous_model(
        tiny_run: Path, tmp_path: Path) -> None:
    assert run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", "--max-steps", "40").returncode == 0

    follow_up = tmp_path / "follow-up"
    prepared = run_cli("prepare", "--run-dir", follow_up, "--demo", "--preset", "tiny", "--seed", "7",
                       "--init-from", tiny_run)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert (follow_up / "prepared" / "tokenizer.json").read_bytes() == \
        (tiny_run / "prepared" / "tokenizer.json").read_bytes()

    result = run_cli(*TRAIN, "--run-dir", follow_up, "--backend", "cpu", "--max-steps", "3", "--init-from", tiny_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "incremental training" in result.stderr
    from_scratch_first_loss = metrics(tiny_run)[0]["loss"]
    assert metrics(follow_up)[0]["loss"] < 0.8 * from_scratch_first_loss


def test_incremental_training_refuses_a_different_tokenizer(tiny_run: Path, tmp_path: Path) -> None:
    assert run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", "--max-steps", "2").returncode == 0
    other = tmp_path / "other"
    shutil.copytree(tiny_run / "prepared", other / "prepared")
    train_tokenizer(["a different corpus entirely"] * 50, 1024).save(str(other / "prepared" / "tokenizer.json"))

    result = run_cli(*TRAIN, "--run-dir", other, "--backend", "cpu", "--max-steps", "2", "--init-from", tiny_run)
    assert result.returncode == ExitCode.BAD_CONFIG, result.stderr[-3000:]
    assert "--init-from" in result.stderr


def test_non_finite_loss_stops_before_the_update_with_its_exit_code(tiny_run: Path) -> None:
    result = run_cli(*TRAIN, "--run-dir", tiny_run, "--backend", "cpu", "--lr", "1e12", "--max-steps", "30")
    assert result.returncode == ExitCode.NON_FINITE_LOSS, result.stderr[-3000:]
    assert "stopped before the optimizer step" in result.stderr


def test_training_streams_its_curves_to_one_mlflow_child_run_every_log_every_steps(
        tiny_prepared: Path, tmp_path: Path, monkeypatch) -> None:
    """loss, lr and tokens/s reach the train child run every --log-every steps while training runs
    (the same run the step completes at the end), not only once training is over."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the default store in the run dir
    run_dir = tmp_path / "streamed"
    shutil.copytree(tiny_prepared, run_dir)
    env = {k: v for k, v in cli_env().items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")}
    result = run_cli("train", "--run-dir", run_dir, "--preset", "tiny", "--backend", "cpu", "--max-steps", 4,
                     "--log-every", 2, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("trainium-embeddings").experiment_id])
    (train,) = [r for r in runs if r.info.run_name == "train" and r.data.tags.get("pipeline.run_id") == "streamed"]
    assert train.info.status == "FINISHED"
    for key in ("loss", "lr", "tokens_per_s"):
        # (step 0: the end-of-training summary value of the same name, e.g. the mean tokens/s)
        steps = [m.step for m in client.get_metric_history(train.info.run_id, key) if m.step > 0]
        assert steps == [2, 4], key
