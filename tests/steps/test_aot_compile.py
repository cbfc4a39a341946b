"""The compile step: the local XLA trial traces every training graph, stably; Neuron command shape."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline_steps import __main__ as cli
from pipeline_steps import aot_compile
from pipeline_steps import distributed as dist_lib
from pipeline_steps.contract import CHECKPOINTS_DIR, COMPILE_DIR, COMPILE_REPORT, PREPARED_DIR
from pipeline_steps.errors import ExitCode
from pipeline_steps.fileio import read_json

from .conftest import run_cli


def test_compile_traces_the_same_graphs_on_every_rerun(tiny_run_local, tmp_path: Path) -> None:
    """The first compile is run-local's (the shared xla run); the rerun uses its arguments on the same
    prepared data in a fresh run dir."""
    shared, run_local = tiny_run_local("xla")
    assert run_local.returncode == 0, run_local.stderr[-3000:]
    rerun_dir = tmp_path / "rerun"
    rerun_dir.mkdir()
    (rerun_dir / PREPARED_DIR).symlink_to(shared / PREPARED_DIR)
    result = run_cli("compile", "--run-dir", rerun_dir, "--preset", "tiny", "--backend", "xla")
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (read_json(run_dir / COMPILE_REPORT) for run_dir in (shared, rerun_dir))
    assert first["graphs_compiled"] == second["graphs_compiled"] > 0
    assert first["batch_shapes"] == second["batch_shapes"]
    # One training step per length bucket covers every training graph (M5: within 4-5 steps).
    assert len(first["batch_shapes"]) == len(first["buckets"])
    phases = first["graphs_by_phase"]
    assert phases["checkpoint"] == phases["validation_step"], "saving a checkpoint traced a graph"
    # The trial never touches the real run's checkpoints.
    assert not (rerun_dir / CHECKPOINTS_DIR).exists()
    assert (rerun_dir / COMPILE_DIR / "trial" / CHECKPOINTS_DIR).is_dir()


def test_compile_on_an_eager_backend_is_a_recorded_no_op(tiny_run: Path) -> None:
    result = run_cli("compile", "--run-dir", tiny_run, "--preset", "tiny", "--backend", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(tiny_run / "compile" / "compile.json")["mode"] == "skipped"


def test_neuron_trial_is_the_training_command_verbatim(tmp_path: Path) -> None:
    train_args = ["--run-dir", "/fsx/runs/r1", "--preset", "base", "--backend", "xla", "--init-from", "/fsx/runs/prev",
                  "--bf16", "--lr", "3e-4"]
    assert aot_compile.training_argv([*train_args[:4], "--steps", "12", *train_args[4:]]) == train_args
    environ = {"TORCHRUN_ARGS": "--nnodes 4 --node_rank 1 --nproc_per_node 32 --master_addr 10.0.0.5 "
                                "--master_port 29500",
               "NEURON_CC_FLAGS": "--target trn1 --optlevel 1"}
    cmd, env = aot_compile.neuron_command(train_args, tmp_path / "trial", 12, environ)
    assert cmd[:2] == ["neuron_parallel_compile", "torchrun"]
    assert cmd[2:12] == environ["TORCHRUN_ARGS"].split()
    train = cmd[cmd.index("train") + 1:]
    assert train[:len(train_args)] == train_args  # verbatim, in order
    assert train[len(train_args):] == ["--run-dir", str(tmp_path / "trial"), "--max-steps", "12", "--no-progress"]
    assert env == environ  # no flag or cache of its own: the environment `train` gets


def _fake_neuron_parallel_compile(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "neuron_parallel_compile"
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{bin_dir}/argv'\n{body}\n")
    tool.chmod(0o755)


@pytest.mark.parametrize(("body", "expected"), [
    ("exit 0", ExitCode.OK),
    # The compiler rejected a graph: the workers ran fine, the wrapper fails. Deterministic.
    ("echo 'ERROR: compilation failed for 1 graph(s)' >&2; exit 1", ExitCode.BAD_CONFIG),
    # A training process recorded a transient fault (collective, device, stall): retried.
    ('echo 75 > "$PIPELINE_EXIT_CODE_FILE"; exit 1', ExitCode.RETRYABLE),
    ('echo 65 > "$PIPELINE_EXIT_CODE_FILE"; exit 1', ExitCode.BAD_INPUT),
    ("kill -9 $$", ExitCode.RETRYABLE),
], ids=["ok", "compiler-error", "transient-worker-fault", "bad-input", "killed"])
def test_neuron_compile_failures_are_retryable_only_when_transient(tmp_path, monkeypatch, body, expected) -> None:
    _fake_neuron_parallel_compile(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "s3://cache/neuron/neuronx-cc-2.25/")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--target trn1")
    monkeypatch.delenv("PIPELINE_EXIT_CODE_FILE", raising=False)
    monkeypatch.setattr(dist_lib, "neuron_available", lambda: True)
    run_dir = tmp_path / "run"
    code = cli.main(["compile", "--run-dir", str(run_dir), "--preset", "tiny", "--backend", "xla", "--bf16",
                     "--steps", "3"])
    assert code == expected
    argv = (tmp_path / "bin" / "argv").read_text().split("\n")
    assert argv[argv.index("train") + 1:argv.index("train") + 8] == [
        "--run-dir", str(run_dir), "--preset", "tiny", "--backend", "xla", "--bf16"]
    if expected == ExitCode.OK:
        report = read_json(run_dir / "compile" / "compile.json")
        assert report["neuron_cc_flags"] == "--target trn1"
        assert report["cache_url"] == "s3://cache/neuron/neuronx-cc-2.25/"
