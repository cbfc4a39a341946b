"""Retrieval and classification metrics (recall@k, MRR, nDCG@k, accuracy) from scores or ranked lists.

Pure numpy / torch, no model code: `validate` and the tests both use these functions, so the numbers
in `gate.json` are the numbers the tests check against hand-computed examples. Relevance is binary,
and a query may have several relevant products.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

RECALL_KS = (1, 10, 100)
NDCG_K = 10
RANK_DEPTH = max(max(RECALL_KS), NDCG_K)
"""How deep `validate` ranks: enough for recall@100 (and so MRR@100)."""
IGNORE_INDEX = -100  # rows without a label: the same ignore index as the training loss
METRIC_KEYS = tuple(f"recall@{k}" for k in RECALL_KS) + ("mrr", f"ndcg@{NDCG_K}", "accuracy")
"""Every key `retrieval_metrics` + `accuracy` can produce, in display order."""


def top_k_by_dot(queries: torch.Tensor, products: torch.Tensor, k: int, *,
                 max_score_elements: int = 1 << 26) -> np.ndarray:
    """Exact top-k products per query by dot product (cosine for unit vectors).

    queries [Q, E], products [N, E] (float, CPU) -> int64 [Q, min(k, N)], best first.
    Queries are scored in chunks so the [chunk, N] score matrix stays under `max_score_elements`
    floats (256 MiB by default) however large the catalog is.
    """
    if queries.ndim != 2 or products.ndim != 2 or queries.shape[1] != products.shape[1]:
        raise ValueError(f"need queries [Q, E] and products [N, E], got {tuple(queries.shape)} "
                         f"and {tuple(products.shape)}")
    num_queries, num_products = queries.shape[0], products.shape[0]
    k = min(k, num_products)
    out = np.empty((num_queries, k), dtype=np.int64)
    chunk = max(1, min(num_queries, max_score_elements // max(1, num_products)))
    products_t = products.float().T.contiguous()
    for start in range(0, num_queries, chunk):
        scores = queries[start:start + chunk].float() @ products_t
        out[start:start + chunk] = torch.topk(scores, k, dim=1, sorted=True).indices.numpy()
    return out


def ranked_from_scores(scores: np.ndarray | torch.Tensor, k: int = RANK_DEPTH) -> np.ndarray:
    """Top-k column indices per row of a full score matrix [Q, N], best first."""
    scores_t = torch.as_tensor(np.asarray(scores, dtype=np.float32))
    k = min(k, scores_t.shape[1])
    return torch.topk(scores_t, k, dim=1, sorted=True).indices.numpy()


def _hits(ranked: np.ndarray, relevant: Sequence[Collection[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Boolean [Q, K] 'ranked[i, j] is relevant to query i', and |relevant| per query [Q]."""
    ranked = np.asarray(ranked, dtype=np.int64)
    if ranked.ndim != 2:
        raise ValueError(f"ranked must be [Q, K], got shape {ranked.shape}")
    if len(relevant) != ranked.shape[0]:
        raise ValueError(f"{ranked.shape[0]} ranked lists but {len(relevant)} relevance sets")
    hits = np.zeros(ranked.shape, dtype=bool)
    num_relevant = np.zeros(ranked.shape[0], dtype=np.int64)
    for i, rel in enumerate(relevant):
        rel_arr = np.fromiter(set(rel), dtype=np.int64)
        if rel_arr.size == 0:
            raise ValueError(f"query {i} has no relevant product; drop it before scoring")
        num_relevant[i] = rel_arr.size
        hits[i] = np.isin(ranked[i], rel_arr)
    return hits, num_relevant


def retrieval_metrics(ranked: np.ndarray, relevant: Sequence[Collection[int]], *,
                      recall_ks: Sequence[int] = RECALL_KS, ndcg_k: int = NDCG_K) -> dict[str, float]:
    """recall@k for each k, MRR and nDCG@ndcg_k, each averaged over queries.

    `ranked` int [Q, K]: product indices per query, best first (K = the deepest cut needed);
    `relevant`: Q collections of product indices (the holdout pairs of that query). A cut deeper
    than the ranked lists (k > K) uses the whole list, which is exact when K equals the catalog size
    (a small catalog ranks every product) and a lower bound otherwise."""
    hits, num_relevant = _hits(ranked, relevant)
    depth = hits.shape[1]
    out: dict[str, float] = {}
    # recall@k = |relevant in top k| / |relevant| (with one relevant product per query: the hit rate).
    for k in recall_ks:
        out[f"recall@{k}"] = float(np.mean(hits[:, :k].sum(axis=1) / num_relevant))

    # MRR = 1 / rank of the first relevant product, 0 when none is in the top K: MRR@K (validate: K = 100).
    any_hit = hits.any(axis=1)
    first = np.where(any_hit, hits.argmax(axis=1), 0)
    out["mrr"] = float(np.mean(np.where(any_hit, 1.0 / (first + 1), 0.0)))

    # nDCG@k = DCG@k / IDCG@k, gain 1 per relevant product, discount 1/log2(rank + 1); the ideal
    # ranking places min(|relevant|, k) relevant products first.
    cut = min(ndcg_k, depth)
    discounts = 1.0 / np.log2(np.arange(2, ndcg_k + 2))
    dcg = (hits[:, :cut] * discounts[:cut]).sum(axis=1)
    ideal_cumsum = np.concatenate([[0.0], np.cumsum(discounts)])
    idcg = ideal_cumsum[np.minimum(num_relevant, ndcg_k)]
    out[f"ndcg@{ndcg_k}"] = float(np.mean(dcg / idcg))
    return out


def metrics_from_scores(scores: np.ndarray | torch.Tensor, relevant: Sequence[Collection[int]], *,
                        recall_ks: Sequence[int] = RECALL_KS, ndcg_k: int = NDCG_K) -> dict[str, float]:
    """`retrieval_metrics` of a full score matrix [Q, N] (higher = better), ranked RANK_DEPTH deep
    (or deeper when a cut asks for it), so MRR means MRR@100 here exactly as in `validate`."""
    depth = max(max(recall_ks), ndcg_k, RANK_DEPTH)
    return retrieval_metrics(ranked_from_scores(scores, depth), relevant, recall_ks=recall_ks, ndcg_k=ndcg_k)


def random_expectation(num_products: int, *, recall_ks: Sequence[int] = RECALL_KS) -> dict[str, float]:
    """Expected recall@k of a uniformly random ranking: k / N for any number of relevant products
    (each relevant product lands in the top k with probability k / N)."""
    return {f"recall@{k}": min(1.0, k / max(1, num_products)) for k in recall_ks}


def accuracy(logits: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> float | None:
    """Argmax accuracy over rows whose label is not -100; None when no row is labelled."""
    logits_np = np.asarray(logits)
    labels_np = np.asarray(labels, dtype=np.int64)
    if logits_np.ndim != 2 or labels_np.shape != (logits_np.shape[0],):
        raise ValueError(f"need logits [R, C] and labels [R], got {logits_np.shape} and {labels_np.shape}")
    keep = labels_np != IGNORE_INDEX
    if not keep.any():
        return None
    return float(np.mean(logits_np[keep].argmax(axis=1) == labels_np[keep]))
