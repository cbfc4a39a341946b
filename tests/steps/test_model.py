"""Behaviour of the two-tower model and its loss (pipeline_steps.model), on the tiny preset."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pipeline_steps.config import PRESETS, ModelConfig, TrainConfig
from pipeline_steps.errors import BadConfigError
from pipeline_steps.model import EmbeddingModel, count_parameters, training_loss

TINY = PRESETS["tiny"]
TRAIN = TrainConfig(temperature=0.05, aux_weight=0.2)
NUM_NUMERIC = 3
CARDINALITIES = (5, 11)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(**overrides) -> ModelConfig:
    values = dict(num_numeric=NUM_NUMERIC, categorical_cardinalities=CARDINALITIES)
    values.update(overrides)
    return dataclasses.replace(TINY.model, **values)


def make_model(seed: int = 0, **overrides) -> EmbeddingModel:
    torch.manual_seed(seed)
    return EmbeddingModel(tiny_cfg(**overrides)).eval()


def random_tokens(gen: torch.Generator, rows: int, length: int, real: int, vocab: int = 1024):
    """ids/mask [rows, length] with `real` real tokens per row (ids >= 5 skip the special tokens)."""
    ids = torch.randint(5, vocab, (rows, length), generator=gen)
    mask = torch.zeros(rows, length, dtype=torch.int64)
    mask[:, :real] = 1
    return ids * mask, mask


def make_batch(rows: int, *, seed: int = 0, num_numeric: int = NUM_NUMERIC,
               cardinalities: tuple[int, ...] = CARDINALITIES, num_classes: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    query_ids, query_mask = random_tokens(gen, rows, 16, 6)
    doc_ids, doc_mask = random_tokens(gen, rows, 32, 12)
    categorical = torch.stack([torch.randint(0, c, (rows,), generator=gen) for c in cardinalities], dim=1) \
        if cardinalities else torch.zeros(rows, 0, dtype=torch.int64)
    return {
        "query_ids": query_ids, "query_mask": query_mask, "doc_ids": doc_ids, "doc_mask": doc_mask,
        "numeric": torch.randn(rows, num_numeric, generator=gen),
        "categorical": categorical,
        "row_mask": torch.ones(rows),
        "weight": torch.rand(rows, generator=gen) + 0.5,
        "class_id": torch.randint(0, max(num_classes, 1), (rows,), generator=gen) if num_classes
        else torch.full((rows,), -100, dtype=torch.int64),
        "product_index": torch.arange(rows, dtype=torch.int64),
    }


def with_padding_rows(batch: dict[str, torch.Tensor], extra: int, seed: int = 99) -> dict[str, torch.Tensor]:
    """Append `extra` padding rows whose *content* is random junk: only row_mask says they are padding."""
    junk = make_batch(extra, seed=seed)
    junk["row_mask"] = torch.zeros(extra)
    junk["weight"] = torch.zeros(extra)
    junk["product_index"] = torch.full((extra,), -1, dtype=torch.int64)
    junk["class_id"] = torch.full((extra,), -100, dtype=torch.int64)
    return {k: torch.cat([batch[k], junk[k]]) for k in batch}


def reference_contrastive(q, p, product_index, row_mask, weight, temperature) -> float:
    """The loss written out row by row, straight from its definition."""
    total = 0.0
    for direction in (0, 1):
        anchors, candidates = (q, p) if direction == 0 else (p, q)
        num, den = 0.0, 0.0
        for i in range(len(q)):
            if row_mask[i] == 0:
                continue
            terms = [float(anchors[i] @ candidates[j]) / temperature for j in range(len(q))
                     if j == i or (row_mask[j] > 0 and product_index[j] != product_index[i])]
            positive = float(anchors[i] @ candidates[i]) / temperature
            num += float(weight[i]) * (math.log(sum(math.exp(t) for t in terms)) - positive)
            den += float(weight[i])
        total += num / den
    return 0.5 * total


# ----------------------------------------------------------------------------- embeddings

def test_embeddings_are_unit_norm_and_of_the_configured_size():
    model = make_model()
    batch = make_batch(8)
    with torch.no_grad():
        q = model.encode_queries(batch["query_ids"], batch["query_mask"])
        p = model.encode_products(batch["doc_ids"], batch["doc_mask"], batch["numeric"], batch["categorical"])
    assert q.shape == p.shape == (8, TINY.model.embedding_dim)
    assert q.dtype == p.dtype == torch.float32
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(8))
    torch.testing.assert_close(p.norm(dim=-1), torch.ones(8))


def test_padding_tokens_do_not_change_a_text_embedding():
    model = make_model()
    batch = make_batch(4)
    short_ids, short_mask = batch["doc_ids"][:, :16], batch["doc_mask"][:, :16]
    long_ids = torch.cat([short_ids, torch.zeros_like(short_ids)], dim=1)  # same text padded to 32
    long_mask = torch.cat([short_mask, torch.zeros_like(short_mask)], dim=1)
    # Junk ids under a zero mask must not matter either.
    junk_ids = long_ids.clone()
    junk_ids[:, 16:] = 7
    args = (batch["numeric"], batch["categorical"])
    with torch.no_grad():
        e16 = model.encode_products(short_ids, short_mask, *args)
        e32 = model.encode_products(long_ids, long_mask, *args)
        e32_junk = model.encode_products(junk_ids, long_mask, *args)
        q16 = model.encode_queries(short_ids, short_mask)
        q32 = model.encode_queries(long_ids, long_mask)
    torch.testing.assert_close(e16, e32, atol=1e-5, rtol=0)
    torch.testing.assert_close(e16, e32_junk, atol=1e-5, rtol=0)
    torch.testing.assert_close(q16, q32, atol=1e-5, rtol=0)


def test_explicit_features_change_the_product_embedding():
    model = make_model()
    batch = make_batch(4)
    with torch.no_grad():
        base = model.encode_products(batch["doc_ids"], batch["doc_mask"], batch["numeric"], batch["categorical"])
        shifted = model.encode_products(batch["doc_ids"], batch["doc_mask"], batch["numeric"] + 3.0,
                                        (batch["categorical"] + 1) % torch.tensor(CARDINALITIES))
    assert (base - shifted).abs().max() > 1e-4


def test_sequence_longer_than_the_position_table_is_a_clear_error():
    model = make_model()
    ids = torch.ones(2, TINY.model.max_positions + 1, dtype=torch.int64)
    with pytest.raises(BadConfigError, match="max_positions"):
        model.encode_queries(ids, torch.ones_like(ids))


def test_bf16_model_gives_finite_unit_embeddings_and_loss():
    model = make_model(num_classes=4).to(torch.bfloat16)
    batch = with_padding_rows(make_batch(8, num_classes=4), 4)
    with torch.no_grad():
        loss, parts = training_loss(model, batch, TRAIN)
        q = model.encode_queries(batch["query_ids"], batch["query_mask"])
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in parts.values())
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(12), atol=1e-2, rtol=0)
    # bf16 forward + backward of an all-padding batch stays finite too.
    model.train()
    empty = dict(batch, row_mask=torch.zeros(12), weight=torch.zeros(12))
    loss, _ = training_loss(model, empty, TRAIN)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_base_preset_has_bert_base_size():
    with torch.device("meta"):  # shapes only: no 440 MB allocation
        model = EmbeddingModel(PRESETS["base"].model)
    assert 105e6 < count_parameters(model) < 115e6


# ----------------------------------------------------------------------------- loss

def test_loss_matches_its_definition_with_padding_and_duplicates():
    model = make_model()
    batch = with_padding_rows(make_batch(6), 2)
    batch["product_index"][3] = batch["product_index"][1]  # rows 1 and 3: same product
    with torch.no_grad():
        loss, parts = training_loss(model, batch, TRAIN)
        out = model(batch["query_ids"], batch["query_mask"], batch["doc_ids"], batch["doc_mask"],
                    batch["numeric"], batch["categorical"])
    expected = reference_contrastive(out["query"], out["product"], batch["product_index"],
                                     batch["row_mask"], batch["weight"], TRAIN.temperature)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert parts["aux"].item() == 0.0


def test_padding_rows_do_not_change_the_loss():
    model = make_model()
    batch = make_batch(8)
    with torch.no_grad():
        plain, _ = training_loss(model, batch, TRAIN)
        padded, _ = training_loss(model, with_padding_rows(batch, 8), TRAIN)
    assert padded.item() == pytest.approx(plain.item(), rel=1e-5)


def test_all_padding_batch_gives_zero_loss_and_finite_gradients():
    model = make_model(num_classes=3).train()
    batch = make_batch(8, num_classes=3)
    batch["row_mask"] = torch.zeros(8)
    batch["weight"] = torch.zeros(8)
    batch["query_mask"] = torch.zeros_like(batch["query_mask"])  # no real token anywhere
    batch["doc_mask"] = torch.zeros_like(batch["doc_mask"])
    loss, parts = training_loss(model, batch, TRAIN)
    loss.backward()
    assert loss.item() == 0.0
    assert parts["aux"].item() == 0.0
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), name


def test_duplicate_products_are_not_negatives():
    """Two rows of the same product: each one's positive must not be pushed away as a negative."""
    model = make_model()
    batch = make_batch(8)
    for key in ("doc_ids", "doc_mask", "numeric", "categorical"):
        batch[key][5] = batch[key][2]  # row 5 shows exactly the product of row 2
    model.eval()
    distinct_ids = batch["product_index"].clone()
    batch["product_index"][5] = batch["product_index"][2]
    with torch.no_grad():
        masked, _ = training_loss(model, batch, TRAIN)
        unmasked, _ = training_loss(model, dict(batch, product_index=distinct_ids), TRAIN)
    # Counting the identical copy as a negative adds a term as large as the positive itself to the
    # denominators of rows 2 and 5 (and of their product anchors): a strictly larger loss.
    assert masked.item() < unmasked.item() - 1e-3


def test_pair_weights_scale_rows():
    model = make_model()
    batch = make_batch(8)
    with torch.no_grad():
        one, _ = training_loss(model, dict(batch, weight=torch.ones(8)), TRAIN)
        scaled, _ = training_loss(model, dict(batch, weight=torch.full((8,), 3.0)), TRAIN)
        skewed, _ = training_loss(model, dict(batch, weight=torch.tensor([5.0] + [1.0] * 7)), TRAIN)
    assert scaled.item() == pytest.approx(one.item(), rel=1e-6)  # a weighted mean, not a sum
    assert skewed.item() != pytest.approx(one.item(), rel=1e-4)


def test_without_numeric_or_categorical_features():
    model = make_model(num_numeric=0, categorical_cardinalities=()).train()
    batch = make_batch(8, num_numeric=0, cardinalities=())
    assert batch["numeric"].shape == (8, 0) and batch["categorical"].shape == (8, 0)
    loss, _ = training_loss(model, batch, TRAIN)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 0


def test_auxiliary_head_adds_weighted_cross_entropy():
    model = make_model(num_classes=4)
    batch = with_padding_rows(make_batch(8, num_classes=4), 4)
    batch["class_id"][0] = -100  # an unlabelled real row
    with torch.no_grad():
        loss, parts = training_loss(model, batch, TRAIN)
        logits = model.classify(model.encode_queries(batch["query_ids"], batch["query_mask"]))
    assert logits.shape == (12, 4)
    ce = F.cross_entropy(logits, batch["class_id"], ignore_index=-100, reduction="none")
    w = batch["weight"] * (batch["class_id"] != -100)
    torch.testing.assert_close(parts["aux"], (ce * w).sum() / w.sum())
    torch.testing.assert_close(loss, parts["contrastive"] + TRAIN.aux_weight * parts["aux"])

    unlabelled = dict(batch, class_id=torch.full((12,), -100, dtype=torch.int64))
    with torch.no_grad():
        loss, parts = training_loss(model, unlabelled, TRAIN)
    assert parts["aux"].item() == 0.0
    torch.testing.assert_close(loss, parts["contrastive"])


def test_classify_without_a_head_is_a_clear_error():
    model = make_model()
    with pytest.raises(BadConfigError, match="num_classes"):
        model.classify(torch.zeros(2, TINY.model.embedding_dim))


# ----------------------------------------------------------------------------- it learns

def test_a_few_hundred_steps_learn_a_synthetic_retrieval_task():
    """Products are random token strings; a query is a shuffled subset of its product's tokens plus
    a noise token. After training, queries must find their product among all products."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    num_products, doc_len, query_len, batch_size = 64, 10, 5, 16
    cfg = tiny_cfg(num_numeric=1, categorical_cardinalities=(4,), dropout=0.0)
    model = EmbeddingModel(cfg)
    train_cfg = TrainConfig(temperature=0.05)

    doc_tokens = torch.randint(5, cfg.vocab_size, (num_products, doc_len), generator=gen)
    docs = torch.zeros(num_products, 16, dtype=torch.int64)
    docs[:, :doc_len] = doc_tokens
    doc_mask = (docs != 0).long()
    numeric = torch.randn(num_products, 1, generator=gen)
    categorical = torch.randint(0, 4, (num_products, 1), generator=gen)

    def queries_for(products: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.stack([torch.randperm(doc_len, generator=gen)[: query_len - 1] for _ in products])
        tokens = torch.cat([doc_tokens[products].gather(1, picks),
                            torch.randint(5, cfg.vocab_size, (len(products), 1), generator=gen)], dim=1)
        ids = torch.zeros(len(products), 16, dtype=torch.int64)
        ids[:, :query_len] = tokens
        return ids, (ids != 0).long()

    def recall_at_1() -> float:
        model.eval()
        with torch.no_grad():
            everything = torch.arange(num_products)
            q = model.encode_queries(*queries_for(everything))
            p = model.encode_products(docs, doc_mask, numeric, categorical)
        model.train()
        return ((q @ p.T).argmax(dim=1) == everything).float().mean().item()

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    recall_before = recall_at_1()
    losses = []
    for _ in range(250):
        products = torch.randperm(num_products, generator=gen)[:batch_size]
        query_ids, query_mask = queries_for(products)
        batch = {
            "query_ids": query_ids, "query_mask": query_mask,
            "doc_ids": docs[products], "doc_mask": doc_mask[products],
            "numeric": numeric[products], "categorical": categorical[products],
            "row_mask": torch.ones(batch_size), "weight": torch.ones(batch_size),
            "class_id": torch.full((batch_size,), -100), "product_index": products,
        }
        loss, _ = training_loss(model, batch, train_cfg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    recall_after = recall_at_1()

    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.3 * first, (first, last)
    assert recall_before < 0.2
    assert recall_after > 0.8, (recall_before, recall_after)
