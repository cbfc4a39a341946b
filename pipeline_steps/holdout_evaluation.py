"""A model on the holdout: the holdout's queries and labels, the model's retrieval metrics and
embeddings, the BM25 baseline's metrics, and the table both are printed in (validate, --compare)."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import retrieval_metrics
from .errors import BadInputError
from .inference import InferenceModel, embed_products, embed_queries

log = logging.getLogger("pipeline_steps.validate")

BM25_PARAMS = {"k1": 1.5, "b": 0.75, "method": "lucene"}


@dataclass
class Holdout:
    """Distinct holdout queries with their relevant products, and the pair rows behind them."""

    queries: list[str]  # [Q] distinct query texts, in first-seen order
    token_ids: np.ndarray  # int32 [Q, query_length]
    lengths: np.ndarray  # int32 [Q]
    relevant: list[set[int]]  # [Q] catalog rows of every holdout pair of the query
    row_query: np.ndarray  # int64 [M] distinct-query index of each holdout pair
    class_id: np.ndarray  # int64 [M] label of each pair (-100 = none)

    @property
    def num_labelled(self) -> int:
        return int((self.class_id != retrieval_metrics.IGNORE_INDEX).sum())


def holdout_queries(pairs: Any) -> Holdout:
    if len(pairs.queries) == 0:
        raise BadInputError("the holdout is empty: prepare held out no query; use more data or a larger "
                            "holdout_fraction and rerun prepare")
    first: dict[str, int] = {}
    row_query = np.empty(len(pairs.queries), dtype=np.int64)
    relevant: list[set[int]] = []
    first_rows: list[int] = []
    for row, (query, product) in enumerate(zip(pairs.queries, pairs.product_index.tolist())):
        q = first.setdefault(query, len(first))
        if q == len(relevant):
            relevant.append(set())
            first_rows.append(row)
        relevant[q].add(int(product))
        row_query[row] = q
    return Holdout(queries=list(first), token_ids=pairs.token_ids[first_rows], lengths=pairs.lengths[first_rows],
                   relevant=relevant, row_query=row_query, class_id=np.asarray(pairs.class_id, dtype=np.int64))


@dataclass
class Evaluation:
    metrics: dict[str, float | None]
    product_embeddings: np.ndarray  # float32 [N, E]
    query_embeddings: np.ndarray  # float32 [Q, E]
    seconds: float


def evaluate_model(inference: InferenceModel, prepared: Any, holdout: Holdout, *, batch_size: int) -> Evaluation:
    """Embed catalog + queries with static-shape batches, rank exactly, compute every metric."""
    t0 = time.monotonic()
    products = prepared.products
    product_emb = embed_products(inference, products, np.arange(len(products.ids)), batch_size=batch_size,
                                 buckets=prepared.data_cfg.length_buckets)
    query_emb, logits = embed_queries(inference, holdout.token_ids, holdout.lengths, batch_size=batch_size,
                                      query_length=prepared.data_cfg.query_length,
                                      with_logits=holdout.num_labelled > 0)
    # Exact ranking: every catalog product for every distinct holdout query, by dot product of unit embeddings.
    ranked = retrieval_metrics.top_k_by_dot(torch.from_numpy(query_emb), torch.from_numpy(product_emb),
                                      retrieval_metrics.RANK_DEPTH)
    result: dict[str, float | None] = dict(retrieval_metrics.retrieval_metrics(ranked, holdout.relevant))
    result["accuracy"] = (retrieval_metrics.accuracy(logits[holdout.row_query], holdout.class_id)
                          if logits is not None else None)
    return Evaluation(result, product_emb, query_emb, time.monotonic() - t0)


def bm25_ranked(product_texts: Sequence[str], queries: Sequence[str], k: int) -> np.ndarray:
    """BM25 top-k catalog rows per query -> int64 [Q, min(k, N)].

    A query none of whose terms occur in the catalog scores 0 everywhere; its list is the
    catalog's first k rows (what any tie order gives), instead of letting bm25s match it to
    products whose text is all stopwords through its empty-token placeholder."""
    import bm25s
    from bm25s.tokenization import Tokenizer

    k = min(k, len(product_texts))
    tokenizer = Tokenizer(lower=True, stopwords="en")
    corpus = tokenizer.tokenize(list(product_texts), return_as="ids", show_progress=False)
    retriever = bm25s.BM25(**BM25_PARAMS)
    retriever.index(corpus, show_progress=False)
    empty_id = tokenizer.get_vocab_dict().get("")
    query_ids = tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
    query_ids = [[t for t in q if t != empty_id] for q in query_ids]
    ranked = np.tile(np.arange(k, dtype=np.int64), (len(queries), 1))
    nonempty = [i for i, q in enumerate(query_ids) if q]
    if nonempty:
        docs, _scores = retriever.retrieve([query_ids[i] for i in nonempty], k=k, show_progress=False, n_threads=1)
        ranked[nonempty] = np.asarray(docs, dtype=np.int64)
    return ranked


def bm25_metrics(prepared: Any, holdout: Holdout) -> dict[str, float | None]:
    ranked = bm25_ranked(prepared.products.texts, holdout.queries, retrieval_metrics.RANK_DEPTH)
    out: dict[str, float | None] = dict(retrieval_metrics.retrieval_metrics(ranked, holdout.relevant))
    out["accuracy"] = None  # BM25 has no classifier
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def print_table(title: str, columns: Mapping[str, Mapping[str, float | None] | None], footer: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    present = {name: values for name, values in columns.items() if values is not None}
    for name in present:
        table.add_column(name, justify="right")
    for key in retrieval_metrics.METRIC_KEYS:
        if all(v.get(key) is None for v in present.values()):
            continue
        table.add_row(key, *(_fmt(v.get(key)) for v in present.values()))
    console = Console(file=sys.stdout, width=110)
    console.print(table)
    if footer:
        console.print(footer, markup=False)
