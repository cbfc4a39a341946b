"""The compile step: the local XLA trial traces every training graph, stably; Neuron command shape."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from pipeline_steps import __main__ as cli
from pipeline_steps import aot_compile
from pipeline_steps import distributed as dist_lib
from pipeline_steps.contract import CHECKPOINTS_DIR, COMPILE_DIR, COMPILE_REPORT, PREPARED_DIR
from pipeline_steps.errors import ExitCode
from pipeline_steps.fileio import read_json

from .conftest import REPO, run_cli


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
    # The trial never touches the real run's checkpoints; a rerun's trial starts afresh, and the
    # earlier one is removed.
    assert not (rerun_dir / CHECKPOINTS_DIR).exists()
    trial = Path(second["trial_dir"])
    assert trial.parent == rerun_dir / aot_compile.TRIALS_DIR and (trial / CHECKPOINTS_DIR).is_dir()
    assert [p.name for p in trial.parent.iterdir()] == [trial.name]


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
    # Launched as the Train job launches `train`: the launcher (torchrun) with the node's arguments.
    assert cmd[:4] == ["neuron_parallel_compile", sys.executable, "-m", "pipeline_steps.launch"]
    assert cmd[4:14] == environ["TORCHRUN_ARGS"].split()
    assert cmd[14:17] == ["-m", "pipeline_steps", "compile"]
    trial = cmd[17:]
    assert trial[:len(train_args)] == train_args  # verbatim, in order
    assert trial[len(train_args):] == ["--steps", "12", "--trial-dir", str(tmp_path / "trial")]
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
    assert argv[argv.index("compile") + 1:argv.index("compile") + 8] == [
        "--run-dir", str(run_dir), "--preset", "tiny", "--backend", "xla", "--bf16"]
    if expected == ExitCode.OK:
        report = read_json(run_dir / "compile" / "compile.json")
        assert report["neuron_cc_flags"] == "--target trn1"
        assert report["cache_url"] == "s3://cache/neuron/neuronx-cc-2.25/"


# ---- many nodes, one shared run dir ------------------------------------------------------------
def _node(run_dir: Path, index: int, start, done, results) -> None:
    """One node of a 4-node Compile job attempt: Batch starts them in any order, seconds apart."""
    environ = {"AWS_BATCH_JOB_ID": f"0a1b2c#{index}", "AWS_BATCH_JOB_ATTEMPT": "2",
               "AWS_BATCH_JOB_NODE_INDEX": str(index), "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}
    start.wait()
    time.sleep(0.1 * ((index * 3) % 4))  # main node neither first nor last
    try:
        trial = aot_compile.prepare_trial(run_dir, environ)
        (trial / CHECKPOINTS_DIR).mkdir(exist_ok=True)
        (trial / CHECKPOINTS_DIR / f"written-by-node-{index}").write_text("x")
        results.put((index, str(trial)))
    except Exception as exc:  # reported to the test, not swallowed
        results.put((index, repr(exc)))
    done.wait()


def test_nodes_preparing_one_trial_at_once_share_it_and_delete_nothing_of_each_other(tmp_path):
    """Every node of the job runs the compile step on the same FSx directory at once. They must
    all land in the same trial, none may remove what another wrote, and only an earlier attempt's
    trial is cleaned up."""
    run_dir = tmp_path / "run"
    (run_dir / PREPARED_DIR).mkdir(parents=True)
    earlier = aot_compile.trial_dir(run_dir, "0a1b2c-attempt1")
    ctx = multiprocessing.get_context("fork")
    start, done, results = ctx.Barrier(4), ctx.Barrier(4), ctx.Queue()
    nodes = [ctx.Process(target=_node, args=(run_dir, i, start, done, results)) for i in range(4)]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(60)
    outcome = dict(results.get(timeout=5) for _ in nodes)
    trial = run_dir / aot_compile.TRIALS_DIR / "0a1b2c-attempt2"
    assert outcome == {i: str(trial) for i in range(4)}
    assert sorted(p.name for p in (trial / CHECKPOINTS_DIR).iterdir()) == [f"written-by-node-{i}" for i in range(4)]
    assert (trial / PREPARED_DIR).resolve() == (run_dir / PREPARED_DIR).resolve()
    assert not earlier.exists()


# ---- the Neuron trial, with the tool's launch replaced by running its command ------------------
def _neuron_environment(tmp_path: Path, monkeypatch, torchrun_args: str) -> None:
    """neuron_parallel_compile runs the command it is given (the real tool also compiles what the
    command traced); the node's TORCHRUN_ARGS as the entrypoint exports them."""
    _fake_neuron_parallel_compile(tmp_path / "bin", 'exec "$@"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("TORCHRUN_ARGS", torchrun_args)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("PIPELINE_EXIT_CODE_FILE", raising=False)
    monkeypatch.setattr(dist_lib, "neuron_available", lambda: True)  # this process only: the ranks run on CPU


def test_the_neuron_trial_traces_every_bucket_the_holdout_and_a_checkpoint(tiny_run, tmp_path, monkeypatch):
    """Each rank neuron_parallel_compile launches runs the local trial's code: the training
    graphs of every length bucket, the validation forward and the checkpoint, so `train`
    compiles nothing the trial did not trace."""
    _neuron_environment(tmp_path, monkeypatch, "--standalone --nproc_per_node 1")
    code = cli.main(["compile", "--run-dir", str(tiny_run), "--preset", "tiny", "--backend", "xla", "--steps", "3"])
    assert code == ExitCode.OK
    report = read_json(tiny_run / COMPILE_REPORT)
    assert report["mode"] == "neuron_parallel_compile"
    trial = report["trial"]
    assert len(trial["batch_shapes"]) == len(trial["buckets"]) >= 2
    assert trial["graphs_by_phase"]["validation_step"] > trial["graphs_by_phase"]["train_steps"]
    assert list((Path(trial["trial_dir"]) / CHECKPOINTS_DIR).glob("step-*.pt"))
    result = run_cli("train", "--run-dir", tiny_run, "--preset", "tiny", "--backend", "xla", "--max-steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(tiny_run / "train" / "xla.json")["graphs_not_in_compile_cache"] == 0


def test_a_trial_whose_nodes_never_meet_is_retried_not_a_compiler_error(tiny_run, tmp_path, monkeypatch):
    """Node 0 of two, and node 1 never starts: torchrun's rendezvous times out. Before, no process
    recorded a code and the step blamed the compiler (78, not retried)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _neuron_environment(tmp_path, monkeypatch, f"--nnodes 2 --node_rank 0 --nproc_per_node 1 "
                                               f"--master_addr 127.0.0.1 --master_port {port} --rdzv_conf timeout=2")
    code = cli.main(["compile", "--run-dir", str(tiny_run), "--preset", "tiny", "--backend", "xla"])
    assert code == ExitCode.RETRYABLE
