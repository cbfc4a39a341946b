"""The compile step: the local XLA trial traces every training graph, stably; Neuron command shape."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline_steps import aot_compile
from pipeline_steps.fileio import read_json

from .conftest import run_cli


def test_compile_traces_the_same_graphs_on_every_rerun(tiny_run: Path) -> None:
    reports = []
    for _ in range(2):
        result = run_cli("compile", "--run-dir", tiny_run, "--preset", "tiny", "--backend", "xla", "--steps", "3")
        assert result.returncode == 0, result.stderr[-3000:]
        reports.append(read_json(tiny_run / "compile" / "compile.json"))
    first, second = reports
    assert first["graphs_compiled"] == second["graphs_compiled"] > 0
    assert first["batch_shapes"] == second["batch_shapes"]
    # One training step per length bucket covers every training graph (M5: within 4-5 steps).
    assert len(first["batch_shapes"]) == len(first["buckets"])
    phases = first["graphs_by_phase"]
    assert phases["checkpoint"] == phases["validation_step"], "saving a checkpoint traced a graph"
    # The trial never touches the real run's checkpoints.
    assert not (tiny_run / "checkpoints").exists()
    assert (tiny_run / "compile" / "trial" / "checkpoints").is_dir()


def test_compile_on_an_eager_backend_is_a_recorded_no_op(tiny_run: Path) -> None:
    result = run_cli("compile", "--run-dir", tiny_run, "--preset", "tiny", "--backend", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(tiny_run / "compile" / "compile.json")["mode"] == "skipped"


def test_neuron_compile_wraps_exactly_the_training_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHRUN_ARGS", "--nnodes 4 --node_rank 1 --nproc_per_node 32 --master_addr 10.0.0.5 "
                                        "--master_port 29500")
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    args = argparse.Namespace(preset="base", epochs=None, lr=3e-4, seed=None, checkpoint_every=None, log_every=None,
                              bf16=True, init_from=Path("/fsx/runs/prev"), steps=10,
                              cache_url="s3://cache-bucket/neuron")
    cmd, env = aot_compile.neuron_command(args, tmp_path / "trial")
    assert cmd[:2] == ["neuron_parallel_compile", "torchrun"]
    assert cmd[2:10] == ["--nnodes", "4", "--node_rank", "1", "--nproc_per_node", "32", "--master_addr", "10.0.0.5"]
    train = cmd[cmd.index("train"):]
    assert ["--preset", "base"] == train[3:5] and "--bf16" in train and "--lr" in train
    assert train[train.index("--init-from") + 1] == "/fsx/runs/prev"
    assert train[train.index("--max-steps") + 1] == "10"
    assert env["NEURON_CC_FLAGS"] == "--target trn1 --model-type transformer --optlevel 1"
    assert env["NEURON_COMPILE_CACHE_URL"].startswith("s3://cache-bucket/neuron/neuronx-cc-")
