"""validate: holdout metrics + BM25 baseline, the quality gate (pass, fail, report-only, S3), --compare."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pipeline_steps import quality_gate, retrieval_metrics
from pipeline_steps.__main__ import main as cli
from pipeline_steps.errors import BadConfigError, BadInputError
from pipeline_steps.fileio import read_json
from tests.steps.conftest import run_cli
from tests.steps.fixtures_trained import checkpoint_at, tiny_trained, trained_run  # noqa: F401  fixtures

RETRIEVAL_KEYS = ("recall@1", "recall@10", "recall@100", "mrr", "ndcg@10")


def _validate(run_dir: Path, *extra: object) -> int:
    return cli(["validate", "--run-dir", str(run_dir), "--backend", "cpu", *map(str, extra)])


def _write_previous(path: Path, values: dict[str, float]) -> Path:
    path.write_text(json.dumps({"passed": True, "metrics": values}))
    return path


@pytest.fixture(scope="module")
def first_validation(tiny_trained: Path, tmp_path_factory) -> dict:
    """One validate run without a previous model, shared by the read-only assertions below."""
    import shutil

    run_dir = tmp_path_factory.mktemp("validate") / "run"
    shutil.copytree(tiny_trained, run_dir)
    code = _validate(run_dir, "--no-sanity-floor")
    return {"code": code, "run_dir": run_dir, "metrics": read_json(run_dir / "validation" / "metrics.json"),
            "gate": read_json(run_dir / "validation" / "gate.json")}


def test_metrics_baseline_and_gate_without_previous(first_validation, capsys):
    assert first_validation["code"] == 0
    report, gate = first_validation["metrics"], first_validation["gate"]
    for key in RETRIEVAL_KEYS:
        assert 0.0 <= report["metrics"][key] <= 1.0
        assert 0.0 <= report["baseline"][key] <= 1.0
    # The demo data shares words between queries and titles: BM25 is far above random.
    assert report["baseline"]["recall@10"] > 5 * report["random"]["recall@10"]
    assert report["baseline"]["accuracy"] is None
    assert report["metrics"]["accuracy"] is not None  # the demo data has category labels
    assert report["holdout"]["products"] == 240 and report["holdout"]["queries"] > 10
    assert report["checkpoint"].endswith("step-000000004.pt") and len(report["checkpoint_sha256"]) == 64

    assert gate["passed"] is True and gate["previous"] is None
    assert any("no previous model" in r for r in gate["reasons"])
    assert gate["metrics"] == report["metrics"] and gate["baseline"] == report["baseline"]
    assert gate["tolerance"] == 0.001 and gate["gated_metrics"] == ["recall@10", "ndcg@10"]
    assert gate["checkpoint_sha256"] == report["checkpoint_sha256"]


def test_gate_passes_when_previous_is_lower(first_validation, trained_run: Path):
    current = first_validation["metrics"]["metrics"]
    previous = _write_previous(trained_run / "prev.json", {k: max(0.0, current[k] - 0.05) for k in RETRIEVAL_KEYS})
    assert _validate(trained_run, "--previous-metrics", previous, "--no-sanity-floor") == 0
    gate = read_json(trained_run / "validation" / "gate.json")
    assert gate["passed"] is True
    assert gate["previous"]["recall@10"] == pytest.approx(max(0.0, current["recall@10"] - 0.05))
    assert sum(r.startswith("ok regression") for r in gate["reasons"]) == 2


def test_gate_fails_when_previous_is_much_higher(trained_run: Path, capsys):
    previous = _write_previous(trained_run / "prev.json", {k: 1.0 for k in RETRIEVAL_KEYS})
    assert _validate(trained_run, "--previous-metrics", previous, "--no-sanity-floor") == 79
    gate = read_json(trained_run / "validation" / "gate.json")
    assert gate["passed"] is False
    failed = [r for r in gate["reasons"] if r.startswith("FAILED")]
    assert any("recall@10" in r for r in failed) and any("ndcg@10" in r for r in failed)
    assert "gate: FAILED" in capsys.readouterr().out

    # Report-only (what the state machine uses): exit 0, the decision stays in gate.json.
    assert _validate(trained_run, "--previous-metrics", previous, "--no-sanity-floor", "--gate-report-only") == 0
    assert read_json(trained_run / "validation" / "gate.json")["passed"] is False


def test_missing_previous_is_no_previous_model_and_floors_still_apply(trained_run: Path):
    assert _validate(trained_run, "--previous-metrics", trained_run / "absent.json",
                     "--floor", "recall@100=1.0", "--floor", "ndcg@10=bm25", "--gate-report-only") == 0
    gate = read_json(trained_run / "validation" / "gate.json")
    assert gate["previous"] is None and any("no previous model" in r for r in gate["reasons"])
    assert gate["floors"] == {"recall@100": 1.0, "ndcg@10": "bm25"}
    # The default sanity floor is on: 2 x 10 / 240 products.
    assert gate["sanity_floor"] == pytest.approx(2 * 10 / 240)
    assert {c["kind"] for c in gate["checks"]} == {"floor", "sanity"}


def test_previous_from_s3_and_gate_upload(trained_run: Path, monkeypatch):
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="artifacts")
        s3.put_object(Bucket="artifacts", Key="models/current.json",
                      Body=json.dumps({"run_id": "old", "metrics": {"recall@10": 1.0, "ndcg@10": 1.0}}))
        assert _validate(trained_run, "--previous-metrics", "s3://artifacts/models/current.json",
                         "--gate-s3-uri", "s3://artifacts/runs/r1/validation/gate.json", "--gate-report-only") == 0
        uploaded = json.loads(s3.get_object(Bucket="artifacts", Key="runs/r1/validation/gate.json")["Body"].read())
        assert uploaded["passed"] is False and uploaded["previous"] == {"recall@10": 1.0, "ndcg@10": 1.0}
        # A rejected model ends the pipeline (ModelRejected): validate closes its MLflow run.
        if importlib.util.find_spec("mlflow") is not None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=(trained_run / "mlruns").resolve().as_uri())
            runs = client.search_runs([client.get_experiment_by_name("trainium-embeddings").experiment_id])
            (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags
                         and r.data.tags.get("pipeline.run_id") == trained_run.name]
            assert parent.info.status == "FINISHED" and parent.data.tags["pipeline.outcome"] == "model_rejected"
        # A previous object that does not exist yet (the first production run) is not an error.
        assert quality_gate.load_previous("s3://artifacts/models/none.json") is None


def test_decide_gate_rules():
    model = {"recall@10": 0.50, "ndcg@10": 0.40, "mrr": 0.3, "accuracy": None}
    baseline = {"recall@10": 0.45, "ndcg@10": 0.41}
    # Exactly previous - tolerance passes (>=); tolerance is absolute.
    passed, reasons, _ = quality_gate.decide_gate(model, baseline=baseline, previous={"recall@10": 0.501, "ndcg@10": 0.3},
                                              gated=("recall@10", "ndcg@10"), tolerance=0.001, floors={},
                                              sanity_floor=None)
    assert passed, reasons
    passed, reasons, _ = quality_gate.decide_gate(model, baseline=baseline, previous={"recall@10": 0.5012, "ndcg@10": 0.3},
                                              gated=("recall@10", "ndcg@10"), tolerance=0.001, floors={},
                                              sanity_floor=None)
    assert not passed and "FAILED regression: recall@10" in reasons[0]
    # Floors: a number, or "bm25" = beat the baseline; a floor on a metric the model lacks fails.
    passed, reasons, _ = quality_gate.decide_gate(model, baseline=baseline, previous=None, gated=(),
                                              tolerance=0.001, floors={"recall@10": "bm25", "ndcg@10": "bm25"},
                                              sanity_floor=None)
    assert not passed and [r.split(":")[0] for r in reasons[1:]] == ["ok floor", "FAILED floor"]
    passed, reasons, _ = quality_gate.decide_gate(model, baseline=baseline, previous=None, gated=(), tolerance=0.001,
                                              floors={"accuracy": 0.5}, sanity_floor=None)
    assert not passed and "accuracy is not available" in reasons[-1]
    # Sanity: strictly above the threshold.
    assert not quality_gate.decide_gate({"recall@10": 0.1}, baseline={}, previous=None, gated=(), tolerance=0.0,
                                    floors={}, sanity_floor=0.1)[0]
    # A previous model without a gated metric is noted, not failed.
    passed, reasons, _ = quality_gate.decide_gate(model, baseline=baseline, previous={"recall@10": 0.2}, gated=("mrr",),
                                              tolerance=0.001, floors={}, sanity_floor=None)
    assert passed and "has no mrr" in reasons[0]


def test_bad_flags_and_previous_files(trained_run: Path):
    with pytest.raises(BadConfigError, match="KEY=VALUE"):
        quality_gate.parse_floors(["recall@7=0.2"], None)
    with pytest.raises(BadConfigError, match="number in"):
        quality_gate.parse_floors(["recall@10=high"], None)
    assert quality_gate.parse_floors([], 0.3) == {"recall@10": 0.3}
    assert _validate(trained_run, "--floor", "nope=1") == 78
    assert _validate(trained_run, "--gate-metric", "recall@10,loss") == 78
    bad = trained_run / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BadInputError, match="not valid JSON"):
        quality_gate.load_previous(str(bad))
    bad.write_text(json.dumps({"metrics": {"loss": 1.0}}))
    with pytest.raises(BadInputError, match="none of the metrics"):
        quality_gate.load_previous(str(bad))
    flat = trained_run / "flat.json"
    flat.write_text(json.dumps({"recall@10": 0.5, "other": 1}))
    assert quality_gate.load_previous(str(flat)) == {"recall@10": 0.5}


def test_tokenizer_mismatch_is_a_clear_error(trained_run: Path, caplog):
    tokenizer = trained_run / "prepared" / "tokenizer.json"
    content = json.loads(tokenizer.read_text())
    tokenizer.write_text(json.dumps(content, indent=1))  # same tokenizer, other bytes: accepted
    assert _validate(trained_run, "--no-sanity-floor") == 0
    vocab = content["model"]["vocab"]
    vocab["renamed-token"] = vocab.pop(next(t for t in vocab if not t.startswith("[")))
    tokenizer.write_text(json.dumps(content))
    assert _validate(trained_run) == 65
    assert "another tokenizer" in caplog.text and "--init-from" in caplog.text


def test_compare_with_itself_is_parity(first_validation, trained_run: Path):
    ckpt = checkpoint_at(trained_run, 4)
    assert _validate(trained_run, "--compare", ckpt, trained_run) == 0  # a run dir resolves to its latest
    report = read_json(trained_run / "validation" / "compare.json")
    assert report["passed"] is True and report["max_abs_delta"] == 0.0
    assert all(v == 0.0 for v in report["deltas"].values())
    assert set(report["deltas"]) == set(retrieval_metrics.METRIC_KEYS)
    assert report["embedding_agreement"]["products"]["mean_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert report["a"]["metrics"] == pytest.approx(first_validation["metrics"]["metrics"])


def test_compare_two_checkpoints_reports_deltas(trained_run: Path):
    a, b = checkpoint_at(trained_run, 2), checkpoint_at(trained_run, 4)
    code = _validate(trained_run, "--compare", a, b, "--tolerance", "0.0")
    report = read_json(trained_run / "validation" / "compare.json")
    assert report["a"]["checkpoint"] == str(a) and report["b"]["checkpoint"] == str(b)
    assert report["a"]["checkpoint_sha256"] != report["b"]["checkpoint_sha256"]
    for key, delta in report["deltas"].items():
        assert delta == pytest.approx(report["b"]["metrics"][key] - report["a"]["metrics"][key])
    assert report["embedding_agreement"]["products"]["mean_cosine"] < 0.9999  # different weights
    assert report["passed"] is (report["max_abs_delta"] <= 0.0)
    assert code == (0 if report["passed"] else 79)


@pytest.mark.slow
def test_compare_eager_cpu_with_xla_same_weights(trained_run: Path):
    """M5's acceptance test: the same checkpoint scored on eager CPU and on XLA (PJRT CPU) agrees,
    and XLA compiles one graph per product length bucket plus one for queries, not per batch."""
    ckpt = checkpoint_at(trained_run, 4)
    result = run_cli("validate", "--run-dir", trained_run, "--compare", ckpt, ckpt, "--backend", "cpu",
                     "--backend-b", "xla", "--batch-size", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_json(trained_run / "validation" / "compare.json")
    assert report["passed"] is True and report["b"]["backend"] == "xla"
    assert report["embedding_agreement"]["products"]["min_cosine"] > 0.9999
    assert report["embedding_agreement"]["queries"]["min_cosine"] > 0.9999
    num_buckets = len(read_json(trained_run / "prepared" / "prepare.json")["data_config"]["length_buckets"])
    assert report["b"]["xla_graphs_compiled"] <= num_buckets + 1
