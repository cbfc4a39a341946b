"""Metrics against examples computed by hand (see the comments for the arithmetic)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline_steps import retrieval_metrics as metrics

# Three queries over five products, ranked best first.
RANKED = np.array([
    [2, 0, 1, 3, 4],  # q0: relevant {0} at rank 2
    [1, 3, 0, 2, 4],  # q1: relevant {1, 2} at ranks 1 and 4
    [4, 3, 2, 1, 0],  # q2: relevant {0} at rank 5
])
RELEVANT = [{0}, {1, 2}, {0}]


def test_recall_mrr_ndcg_by_hand():
    got = metrics.retrieval_metrics(RANKED, RELEVANT, recall_ks=(1, 3), ndcg_k=3)
    # recall@1: q0 0, q1 1/2 (one of two relevant), q2 0
    assert got["recall@1"] == pytest.approx((0 + 0.5 + 0) / 3)
    # recall@3: q0 1, q1 1/2, q2 0
    assert got["recall@3"] == pytest.approx((1 + 0.5 + 0) / 3)
    # MRR: 1/2, 1/1, 1/5
    assert got["mrr"] == pytest.approx((0.5 + 1.0 + 0.2) / 3)
    # nDCG@3: q0 (1/log2 3) / 1; q1 1 / (1 + 1/log2 3); q2 0
    ndcg_q0 = 1 / math.log2(3)
    ndcg_q1 = 1 / (1 + 1 / math.log2(3))
    assert got["ndcg@3"] == pytest.approx((ndcg_q0 + ndcg_q1 + 0) / 3)


def test_perfect_ranking_scores_one_and_mrr_zero_beyond_depth():
    perfect = metrics.retrieval_metrics(np.array([[0, 1, 2], [1, 0, 2]]), [{0, 1}, {1}],
                                        recall_ks=(1, 2), ndcg_k=2)
    assert perfect["ndcg@2"] == pytest.approx(1.0)
    assert perfect["mrr"] == pytest.approx(1.0)
    assert perfect["recall@2"] == pytest.approx(1.0)
    assert perfect["recall@1"] == pytest.approx((0.5 + 1.0) / 2)  # two relevant, one slot

    # The relevant product is not in the (truncated) ranked list at all: contributes 0.
    missed = metrics.retrieval_metrics(np.array([[3, 4]]), [{0}], recall_ks=(1,), ndcg_k=2)
    assert missed == {"recall@1": 0.0, "mrr": 0.0, "ndcg@2": 0.0}


def test_metrics_from_scores_matches_ranked_lists():
    # Scores that rank products exactly as RANKED does.
    scores = np.zeros((3, 5), dtype=np.float32)
    for i, row in enumerate(RANKED):
        scores[i, row] = np.arange(5, 0, -1)
    from_scores = metrics.metrics_from_scores(scores, RELEVANT, recall_ks=(1, 3), ndcg_k=3)
    assert from_scores == pytest.approx(metrics.retrieval_metrics(RANKED, RELEVANT, recall_ks=(1, 3), ndcg_k=3))
    # Default keys; recall@100 on a 5-product catalog ranks everything -> 1.0.
    default = metrics.metrics_from_scores(scores, RELEVANT)
    assert set(default) == {"recall@1", "recall@10", "recall@100", "mrr", "ndcg@10"}
    assert default["recall@100"] == 1.0


def test_top_k_by_dot_chunks_give_the_exact_ranking():
    gen = torch.Generator().manual_seed(0)
    queries = torch.nn.functional.normalize(torch.randn(37, 8, generator=gen), dim=1)
    products = torch.nn.functional.normalize(torch.randn(50, 8, generator=gen), dim=1)
    full = torch.topk(queries @ products.T, 10, dim=1).indices.numpy()
    # max_score_elements=120 forces chunks of 2 queries.
    chunked = metrics.top_k_by_dot(queries, products, 10, max_score_elements=120)
    np.testing.assert_array_equal(chunked, full)
    assert metrics.top_k_by_dot(queries, products, 500).shape == (37, 50)  # k clipped to N


def test_accuracy_ignores_unlabelled_rows():
    logits = np.array([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0], [0.0, 1.0]])
    labels = np.array([0, 0, -100, 1])
    assert metrics.accuracy(logits, labels) == pytest.approx(2 / 3)
    assert metrics.accuracy(logits, np.full(4, -100)) is None


def test_random_expectation_and_bad_input():
    assert metrics.random_expectation(200) == {"recall@1": 0.005, "recall@10": 0.05, "recall@100": 0.5}
    assert metrics.random_expectation(50)["recall@100"] == 1.0
    with pytest.raises(ValueError, match="no relevant product"):
        metrics.retrieval_metrics(np.array([[0, 1]]), [set()])
    with pytest.raises(ValueError, match="relevance sets"):
        metrics.retrieval_metrics(np.array([[0, 1]]), [{0}, {1}])
