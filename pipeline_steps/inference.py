"""Inference from a checkpoint: load the model on a device, check it can read the prepared data, and
embed products and queries in static-shape batches. `embed` and `validate` both use it, so both
steps embed exactly the same way.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import distributed
from .errors import BadInputError, RetryableError
from .fileio import sha256_file
from .model import EmbeddingModel

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 64
"""Rows per inference batch. Fixed per run (static shapes); larger than the training batch is
fine because inference keeps no activations for backward."""


# ============================================================================ model loading

@dataclass
class InferenceModel:
    """A checkpoint's model on a device, in eval mode, ready for static-shape batches."""

    model: EmbeddingModel
    state: dict[str, Any]
    world: distributed.World
    checkpoint: Path
    checkpoint_sha256: str

    @property
    def embedding_dim(self) -> int:
        return int(self.state["config"]["model"]["embedding_dim"])

    @property
    def num_classes(self) -> int:
        return int(self.state["config"]["model"].get("num_classes", 0))


def resolve_checkpoint(checkpoint_or_run_dir: str | os.PathLike) -> tuple[Path, str]:
    """(checkpoint path, sha256 of its bytes) for a .pt file or a run dir (-> latest valid)."""
    from . import checkpoint

    path = checkpoint.resolve(checkpoint_or_run_dir)
    return path, sha256_file(path)


def load_for_inference(checkpoint_or_run_dir: str | os.PathLike, backend: str, *,
                       sha256: str | None = None) -> InferenceModel:
    """`sha256`: the file's digest when the caller already has it (hashing a large checkpoint
    on FSx costs seconds)."""
    from . import checkpoint

    if sha256 is None:
        path, digest = resolve_checkpoint(checkpoint_or_run_dir)
    else:
        path, digest = Path(checkpoint_or_run_dir), sha256
    model, state = checkpoint.load_model(path)
    world = distributed.init(backend)
    model = model.to(world.device).eval()
    log.info("loaded %s (step %s, sha256 %s...) on %s", path, state.get("step"), digest[:12], world.device)
    return InferenceModel(model, state, world, path, digest)


def check_compatible(inference: InferenceModel, prepared: Any) -> list[str]:
    """Fail when the checkpoint cannot read the prepared data (other tokenizer, other feature
    shapes); return warnings for differences that only shift the numbers (feature statistics)."""
    token_state = inference.state.get("tokenizer") or {}
    tokenizer_file = Path(prepared.tokenizer_path)
    file_bytes = tokenizer_file.read_bytes()
    same_tokenizer = token_state.get("sha256") == sha256_file(tokenizer_file)
    if not same_tokenizer and token_state.get("json"):
        # Same content, other formatting (e.g. re-serialised by another tokenizers version) is fine.
        same_tokenizer = json.loads(token_state["json"]) == json.loads(file_bytes.decode("utf-8"))
    if token_state and not same_tokenizer:
        raise BadInputError(
            f"checkpoint {inference.checkpoint} was trained with another tokenizer than "
            f"{tokenizer_file}: token ids would mean different words. Prepare this run dir from the "
            f"model (`prepare --init-from {inference.checkpoint} ...`) or pass the matching --checkpoint"
        )
    cfg = inference.state["config"]["model"]
    products = prepared.products
    num_numeric = products.numeric.shape[1] if products.numeric.ndim == 2 else 0
    num_categorical = products.categorical.shape[1] if products.categorical.ndim == 2 else 0
    cardinalities = tuple(cfg.get("categorical_cardinalities", ()))
    if int(cfg.get("num_numeric", 0)) != num_numeric or len(cardinalities) != num_categorical:
        raise BadInputError(
            f"checkpoint {inference.checkpoint} expects {cfg.get('num_numeric', 0)} numeric and "
            f"{len(cardinalities)} categorical features, the prepared data has {num_numeric} and "
            f"{num_categorical}; validate/embed with a checkpoint trained on this data's schema"
        )
    if num_categorical and products.categorical.size:
        too_big = products.categorical.max(axis=0) >= np.asarray(cardinalities)
        if too_big.any():
            raise BadInputError(
                f"categorical feature ids exceed the checkpoint's vocabularies (columns "
                f"{np.flatnonzero(too_big).tolist()}); the data was prepared with another schema"
            )
    warnings = []
    state_schema = inference.state.get("schema")
    if state_schema is not None and dataclasses.is_dataclass(prepared.schema) and not isinstance(prepared.schema, type):
        if _jsonable(state_schema) != _jsonable(dataclasses.asdict(prepared.schema)):
            warnings.append("the checkpoint's feature schema (normalisation statistics or category "
                            "vocabularies) differs from the prepared data's; numbers may shift")
    for warning in warnings:
        log.warning("%s: %s", inference.checkpoint, warning)
    return warnings


def _jsonable(obj: Any) -> Any:
    """Tuples -> lists recursively, so a dataclass dict compares equal to its JSON round trip."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


# ============================================================================ static-shape inference

@contextlib.contextmanager
def _no_autograd(world: distributed.World) -> Iterator[None]:
    # inference_mode tensors cannot enter an XLA graph in every torch-xla release; no_grad gives
    # the same saving there (no autograd graph) without that risk.
    with (torch.no_grad() if world.is_xla else torch.inference_mode()):
        yield


def _run_batches(inference: InferenceModel, batches: Iterator[tuple[Any, ...]], num_rows: int,
                 width: int, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                 row_inputs: Callable[[np.ndarray], dict[str, torch.Tensor]] | None = None) -> np.ndarray:
    """Run `forward` over data.text_batches output and scatter the real rows back into input
    order -> float32 [num_rows, width]. `row_inputs(indices)` adds per-row tensors (features) to
    each batch; padding rows (index -1) get row 0's values and are dropped afterwards."""
    out = np.full((num_rows, width), np.nan, dtype=np.float32)
    world = inference.world
    pending: collections.deque[np.ndarray] = collections.deque()

    def as_dicts() -> Iterator[dict[str, torch.Tensor]]:
        for indices, ids, mask, _n_real in batches:
            indices = np.asarray(indices, dtype=np.int64)
            pending.append(indices)
            batch = {"ids": torch.as_tensor(ids, dtype=torch.int64), "mask": torch.as_tensor(mask, dtype=torch.int64)}
            if row_inputs is not None:
                batch.update(row_inputs(np.maximum(indices, 0)))
            yield batch

    with _no_autograd(world):
        # device_batches keeps order, so `pending` (filled as batches are produced, possibly
        # ahead of the device on XLA's background loader) is consumed first-in first-out.
        for batch in distributed.device_batches(world, as_dicts()):
            result = forward(batch)
            distributed.mark_step(world)
            indices = pending.popleft()
            real = indices >= 0
            out[indices[real]] = result.float().cpu().numpy()[real]
    if np.isnan(out).any():
        bad = np.flatnonzero(np.isnan(out).any(axis=1))
        raise RetryableError(f"{bad.size} rows got no or non-finite embeddings (first rows {bad[:5].tolist()}); "
                             "a device fault is the likely cause -- rerun the step")
    return out


def embed_products(inference: InferenceModel, products: Any, rows: np.ndarray, *, batch_size: int,
                   buckets: Sequence[int]) -> np.ndarray:
    """L2-normalised embeddings of catalog rows `rows` (in that order) -> float32 [len(rows), E]."""
    from .static_batches import text_batches

    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.zeros((0, inference.embedding_dim), dtype=np.float32)
    numeric = np.asarray(products.numeric, dtype=np.float32)[rows]
    categorical = np.asarray(products.categorical, dtype=np.int64)[rows]

    def row_inputs(index: np.ndarray) -> dict[str, torch.Tensor]:
        # Gathered on CPU per batch and uploaded with the token ids: same shapes every batch.
        return {"numeric": torch.from_numpy(numeric[index]), "categorical": torch.from_numpy(categorical[index])}

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return inference.model.encode_products(batch["ids"], batch["mask"], batch["numeric"], batch["categorical"])

    batches = text_batches(products.token_ids[rows], products.lengths[rows], batch_size, tuple(buckets))
    return _run_batches(inference, batches, rows.size, inference.embedding_dim, forward, row_inputs)


def embed_queries(inference: InferenceModel, token_ids: np.ndarray, lengths: np.ndarray, *, batch_size: int,
                  query_length: int, with_logits: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Query embeddings [n, E] and, with `with_logits`, the auxiliary head's logits [n, C]
    (computed in the same graph as the embedding)."""
    from .static_batches import text_batches

    dim, num_classes = inference.embedding_dim, inference.num_classes
    with_logits = with_logits and num_classes > 0

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        emb = inference.model.encode_queries(batch["ids"], batch["mask"])
        return torch.cat([emb, inference.model.classify(emb)], dim=1) if with_logits else emb

    width = dim + (num_classes if with_logits else 0)
    out = _run_batches(inference, text_batches(token_ids, lengths, batch_size, (query_length,)),
                       len(lengths), width, forward)
    return out[:, :dim], (out[:, dim:] if with_logits else None)
