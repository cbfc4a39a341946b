"""Static-shape batches over pre-tokenised arrays: `TrainBatches` (training: bucketed, sharded per
rank, seeded order) and `text_batches` (inference: every row once, sorted by length), so a batch
is a few vectorised gathers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .feature_schema import IGNORE_INDEX
from .prepared_data import PreparedData

if TYPE_CHECKING:  # torch is imported lazily: `prepare` never needs it
    import torch



def bucket_index(lengths: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """int64 [n]: index of the smallest bucket >= each length (the largest when none is)."""
    return np.minimum(np.searchsorted(np.asarray(buckets), lengths, side="left"), len(buckets) - 1).astype(np.int64)


def _pad_rows(rows: np.ndarray, batch_size: int) -> np.ndarray:
    """Row indices padded with -1 to a multiple of batch_size, as [num_batches, batch_size]."""
    padded = np.full(-(-len(rows) // batch_size) * batch_size, -1, dtype=np.int64)
    padded[:len(rows)] = rows
    return padded.reshape(-1, batch_size)


def _gather(token_ids: np.ndarray, lengths: np.ndarray, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """ids, mask int64 [B, width] for `rows` (-1 = padding row: all 0). No per-token Python loop."""
    real = rows >= 0
    safe = np.where(real, rows, 0)
    lens = np.where(real, np.minimum(lengths[safe], width), 0)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    cols = min(width, token_ids.shape[1])
    ids[:, :cols] = token_ids[safe, :cols]
    mask = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
    return ids * mask, mask


class TrainBatches:
    """Static-shape training batches of the train pairs, sharded per rank, seeded per epoch.

    Each pair goes to the smallest length bucket that holds its product's text. Within a bucket
    pairs are shuffled and cut into global steps of world_size batches of exactly `batch_size`
    rows, one per rank (the last step padded with masked rows, never dropped: fully-masked
    batches if need be); the steps of all buckets are then shuffled together. So in every step
    all ranks run the same bucket's graph (none waits for a longer bucket), and every rank steps
    the same number of times (a rank that stops early hangs the collective of the others). The
    order is a function of (seed, epoch): a resumed run continues it.
    """

    def __init__(self, data: PreparedData, batch_size: int, *, rank: int, world_size: int, seed: int):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size {batch_size} / rank {rank} / world_size {world_size}")
        self.data = data
        self.batch_size = batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.buckets = tuple(data.data_cfg.length_buckets)
        doc_lengths = data.products.lengths[data.train.product_index]
        which = bucket_index(doc_lengths, self.buckets)
        self._members = [np.flatnonzero(which == b) for b in range(len(self.buckets))]
        # No pairs at all (an empty holdout) means zero batches, not an error.
        self._steps = sum(-(-len(m) // (batch_size * world_size)) for m in self._members)

    def num_batches(self) -> int:
        """Batches per rank per epoch; identical on every rank and in every epoch."""
        return self._steps

    def _schedule(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """This rank's (bucket, row indices [B]) for `epoch`; the same on every call."""
        rng = np.random.default_rng([self.seed, epoch])
        steps: list[tuple[int, np.ndarray]] = []  # (bucket, row indices [world_size, B])
        for b, members in enumerate(self._members):
            for rows in _pad_rows(rng.permutation(members), self.batch_size * self.world_size):
                steps.append((b, rows.reshape(self.world_size, self.batch_size)))
        return [(steps[i][0], steps[i][1][self.rank]) for i in rng.permutation(len(steps))]

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """The batches of `epoch` for this rank, skipping the first `start` (resume mid-epoch)."""
        for bucket, rows in self._schedule(epoch)[start:]:
            yield self._batch(bucket, rows)

    def first_batch_per_bucket(self) -> list[dict[str, torch.Tensor]]:
        """One real batch per bucket that has pairs: every shape training will use (compile trial)."""
        return [self._batch(b, _pad_rows(m[:self.batch_size], self.batch_size)[0])
                for b, m in enumerate(self._members) if len(m)]

    def _batch(self, bucket: int, rows: np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        train, products = self.data.train, self.data.products
        real = rows >= 0
        safe = np.where(real, rows, 0)
        product = np.where(real, train.product_index[safe], -1)
        product_safe = np.maximum(product, 0)
        query_ids, query_mask = _gather(train.token_ids, train.lengths, rows, train.token_ids.shape[1])
        doc_ids, doc_mask = _gather(products.token_ids, products.lengths, product, self.buckets[bucket])
        arrays = {
            "query_ids": query_ids, "query_mask": query_mask, "doc_ids": doc_ids, "doc_mask": doc_mask,
            "numeric": products.numeric[product_safe] * real[:, None].astype(np.float32),
            "categorical": products.categorical[product_safe] * real[:, None],
            "row_mask": real.astype(np.float32),
            "weight": np.where(real, train.weight[safe], 0.0).astype(np.float32),
            "class_id": np.where(real, train.class_id[safe], IGNORE_INDEX).astype(np.int64),
            "product_index": product.astype(np.int64),
        }
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def text_batches(token_ids: np.ndarray, lengths: np.ndarray, batch_size: int,
                 buckets: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """Inference batches (validate, embed): (indices int64 [B], ids int64 [B, L], mask int64 [B, L],
    n_real). Rows are sorted by length and cut per bucket into exactly `batch_size` rows; the last
    batch of a bucket is padded with masked rows whose index is -1. Every input index appears once."""
    buckets = tuple(sorted(buckets))
    order = np.argsort(lengths, kind="stable")
    which = bucket_index(lengths[order], buckets)
    for b, width in enumerate(buckets):
        members = order[which == b]
        for rows in _pad_rows(members, batch_size):
            ids, mask = _gather(token_ids, lengths, rows, width)
            yield rows, ids, mask, int((rows >= 0).sum())
