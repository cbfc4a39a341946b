"""`export`: the towers as sentence-transformers folders that reproduce the project's embeddings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline_steps import checkpoint, data as data_lib, inference as inference_lib
from pipeline_steps.config import ModelConfig, from_dict, to_dict
from pipeline_steps.model import EmbeddingModel
from tests.steps.conftest import run_cli
from tests.steps.fixtures_trained import tiny_trained, trained_run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

QUERIES = ["leather hiking boots", "cheap red cotton t-shirt for kids", "usb",
           # Longer than the tiny preset's 16 query tokens: must be truncated exactly like prepare.
           "premium waterproof breathable lightweight trail running shoes with extra cushioning for long races"]


def _sentence_transformer(folder: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _project_queries(ckpt: Path, texts: list[str]) -> np.ndarray:
    inference = inference_lib.load_for_inference(ckpt, "cpu")
    state = inference.state
    tokenizer = data_lib.Tokenizer.from_str(state["tokenizer"]["json"])
    length = state["config"]["data"]["query_length"]
    ids, lengths = data_lib.encode_texts(tokenizer, texts, length)
    return inference_lib.embed_queries(inference, ids, lengths, batch_size=4, query_length=length)[0]


def _project_products(ckpt: Path, texts: list[str]) -> np.ndarray:
    inference = inference_lib.load_for_inference(ckpt, "cpu")
    state = inference.state
    tokenizer = data_lib.Tokenizer.from_str(state["tokenizer"]["json"])
    buckets = state["config"]["data"]["length_buckets"]
    ids, lengths = data_lib.encode_texts(tokenizer, texts, max(buckets))
    products = SimpleNamespace(token_ids=ids, lengths=lengths, numeric=np.zeros((len(texts), 0), np.float32),
                               categorical=np.zeros((len(texts), 0), np.int64))
    return inference_lib.embed_products(inference, products, np.arange(len(texts)), batch_size=4, buckets=buckets)


def test_trained_query_tower_loads_in_sentence_transformers_with_the_projects_embeddings(
        trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    result = run_cli("export", "--checkpoint", trained_run, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "export.json").read_text())
    # The demo catalog has numeric and categorical features: only the query tower is text-only.
    assert list(report["towers"]) == ["query"] and not (out / "product").exists()
    exported = _sentence_transformer(out / "query").encode(QUERIES, convert_to_numpy=True)
    expected = _project_queries(checkpoint.resolve(trained_run), QUERIES)
    assert exported.shape == expected.shape
    assert _cosines(exported, expected).min() > 1 - 1e-4


@pytest.mark.parametrize(("norm_position", "head"), [("pre", "mlp"), ("post", "mlp"), ("post", "linear")])
def test_both_towers_of_a_featureless_model_match_in_sentence_transformers(
        trained_run: Path, tmp_path: Path, norm_position: str, head: str) -> None:
    """A catalog without explicit features: the product tower is text-only and exported too. "post"
    is the layout of an encoder started from BERT (exported as a transformers BertModel), with the
    one-Linear heads such a run trains (one Dense each)."""
    state = checkpoint.load(checkpoint.resolve(trained_run))
    cfg = from_dict(ModelConfig, dict(state["config"]["model"]))
    cfg = dataclasses.replace(cfg, num_numeric=0, categorical_cardinalities=(), num_classes=0,
                              norm_position=norm_position, layer_norm_eps=1e-12 if norm_position == "post" else 1e-5,
                              head=head, embedding_dim=cfg.hidden_size if head == "linear" else cfg.embedding_dim)
    torch.manual_seed(1)
    model = EmbeddingModel(cfg)
    with torch.no_grad():
        for param in model.parameters():  # LayerNorm gains/biases too: every exported tensor matters
            param.add_(torch.randn_like(param) * 0.2)
    run_dir = tmp_path / "featureless"
    state = {**state, "model": model.state_dict(), "config": {**state["config"], "model": to_dict(cfg)}}
    ckpt = checkpoint.save(run_dir, state, keep=2)
    out = tmp_path / "export"
    result = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "export.json").read_text())
    assert set(report["towers"]) == {"query", "product"}
    assert report["encoder"] == ("BertModel" if norm_position == "post" else "RobertaPreLayerNormModel")
    dense = sorted(p.name for p in (out / "query").glob("*_Dense"))
    assert dense == (["2_Dense"] if head == "linear" else ["2_Dense", "3_Dense"])
    queries = _sentence_transformer(out / "query").encode(QUERIES, convert_to_numpy=True)
    assert _cosines(queries, _project_queries(ckpt, QUERIES)).min() > 1 - 1e-4
    titles = ["Trail running shoe, waterproof", "Cotton t-shirt red kids", QUERIES[-1] * 3]
    products = _sentence_transformer(out / "product").encode(titles, convert_to_numpy=True)
    assert _cosines(products, _project_products(ckpt, titles)).min() > 1 - 1e-4


def test_export_replaces_an_earlier_export_and_refuses_a_missing_checkpoint(trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    (out / "stale").mkdir(parents=True)
    assert run_cli("export", "--checkpoint", trained_run, "--out", out).returncode == 0
    assert not (out / "stale").exists() and (out / "query" / "modules.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "run"]  # no staging leftovers
    result = run_cli("export", "--checkpoint", tmp_path / "nope", "--out", out)
    assert result.returncode == 65 and "does not exist" in result.stderr


def test_s3_upload_writes_every_file_then_the_marker_and_a_failed_retry_leaves_no_marker(
        trained_run: Path, tmp_path: Path, monkeypatch) -> None:
    """The pointer names s3://.../export/ once the job succeeded: every file is there, _SUCCESS last."""
    import boto3
    import moto
    from botocore.exceptions import EndpointConnectionError

    from pipeline_steps import export

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    out, prefix = tmp_path / "export", "runs/r1/export/"
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="artifacts")
        written: list[str] = []
        put_object = s3.put_object  # upload_file of a small file is one put_object too
        s3.put_object = lambda **kw: (written.append(kw["Key"]), put_object(**kw))[1]
        monkeypatch.setattr("pipeline_steps.s3.client", lambda: s3)
        assert export.main(["--checkpoint", str(trained_run), "--out", str(out), "--s3-uri", f"s3://artifacts/{prefix}"]) == 0

        local = sorted(prefix + p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        assert sorted(written[:-1]) == local and written[-1] == prefix + export.MARKER  # the marker last
        listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="artifacts", Prefix=prefix)["Contents"])
        assert listed == sorted([*local, prefix + export.MARKER])
        report = json.loads(s3.get_object(Bucket="artifacts", Key=prefix + "export.json")["Body"].read())
        assert report["towers"]["query"]["path"] == "query"

        # A retried attempt that fails half-way leaves no marker from the earlier attempt.
        def unreachable(*args, **kwargs):
            raise EndpointConnectionError(endpoint_url="https://s3.us-east-1.amazonaws.com")

        s3.upload_file = unreachable
        with pytest.raises(Exception, match="upload the export"):
            export.upload(out, f"s3://artifacts/{prefix}")
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="artifacts", Prefix=prefix)["Contents"]}
        assert prefix + export.MARKER not in keys


def test_export_refuses_an_s3_uri_that_is_not_one_before_loading_the_model(tmp_path: Path) -> None:
    result = run_cli("export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "out", "--s3-uri", "artifacts/x")
    assert result.returncode == 78, result.stderr
    assert "--s3-uri 'artifacts/x': expected s3://bucket/prefix/" in result.stderr


def test_export_of_a_pipeline_run_closes_its_mlflow_run_with_the_gate_metrics(
        trained_run: Path, tmp_path: Path, monkeypatch) -> None:
    """On AWS the Export job is the last Batch job of a run that passed the gate: with --run-dir it
    logs its child run and closes the pipeline's MLflow run (file store in the run dir here)."""
    from mlflow.tracking import MlflowClient

    from pipeline_steps import export, tracking

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RANK", "AWS_BATCH_JOB_NODE_INDEX", "PIPELINE_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracking, "_warned", False)
    (trained_run / "validation").mkdir(exist_ok=True)
    (trained_run / "validation" / "gate.json").write_text(json.dumps({"passed": True, "metrics": {"recall@10": 0.75}}))
    assert export.main(["--run-dir", str(trained_run), "--checkpoint", str(trained_run),
                        "--out", str(trained_run / "export")]) == 0

    client = MlflowClient(tracking_uri=(trained_run / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT).experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags
                 and r.data.tags.get(tracking.RUN_ID_TAG) == trained_run.name]
    assert parent.info.status == "FINISHED" and parent.data.tags[tracking.OUTCOME_TAG] == "exported"
    assert parent.data.metrics["recall_at_10"] == 0.75
    (child,) = [r for r in runs if r.info.run_name == "export"]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
