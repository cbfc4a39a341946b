"""The feature schema: names, normalisation and vocabularies of the explicit features and the
classes, fixed at the first prepare of a lineage (docs/data.md, "Outputs")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BadInputError
from .fileio import atomic_write_json, read_json
from .record_validation import ProductRecord

NUMERIC_CLIP = 10.0
"""Normalised numeric features are clipped to +-this many standard deviations, so one absurd
price cannot saturate the fusion MLP."""

IGNORE_INDEX = -100
"""Class id of rows without a label (torch's cross_entropy default ignore_index)."""


@dataclass(frozen=True)
class Schema:
    """Names, normalisation and vocabularies of the explicit features, fixed at the first prepare
    and reused unchanged by incremental runs (`--init-from`) so a model keeps its input layout."""

    numeric_names: tuple[str, ...] = ()
    numeric_mean: tuple[float, ...] = ()
    numeric_std: tuple[float, ...] = ()
    categorical_names: tuple[str, ...] = ()
    categorical_vocabs: tuple[tuple[str, ...], ...] = ()
    """Values of each categorical feature; id = index + 1, 0 = unknown/missing."""
    class_names: tuple[str, ...] = ()
    """Classes of the auxiliary head; empty = no head."""

    def __post_init__(self) -> None:
        if not len(self.numeric_names) == len(self.numeric_mean) == len(self.numeric_std):
            raise BadInputError("schema: numeric_names, numeric_mean and numeric_std differ in length")
        if len(self.categorical_names) != len(self.categorical_vocabs):
            raise BadInputError("schema: categorical_names and categorical_vocabs differ in length")

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(len(v) + 1 for v in self.categorical_vocabs)

    @classmethod
    def fit(cls, products: Sequence[ProductRecord], pair_labels: Iterable[str | None] = ()) -> Schema:
        """Learn the schema from validated products (and pair labels, which add classes)."""
        numeric_names = sorted({k for p in products for k in p.numeric})
        means, stds = [], []
        for name in numeric_names:
            values = np.array([p.numeric[name] for p in products if name in p.numeric], dtype=np.float64)
            std = float(values.std())
            means.append(float(values.mean()))
            stds.append(std if std > 1e-6 else 1.0)  # a constant feature: avoid dividing by zero
        categorical_names = sorted({k for p in products for k in p.categorical})
        vocabs = tuple(tuple(sorted({p.categorical[n] for p in products if n in p.categorical}))
                       for n in categorical_names)
        classes = {p.category for p in products if p.category} | {lbl for lbl in pair_labels if lbl}
        return cls(tuple(numeric_names), tuple(means), tuple(stds), tuple(categorical_names), vocabs,
                   tuple(sorted(classes)))

    def numeric_matrix(self, products: Sequence[ProductRecord]) -> np.ndarray:
        """float32 [N, F]: z-scored and clipped; a missing feature is the mean (0)."""
        out = np.zeros((len(products), len(self.numeric_names)), dtype=np.float32)
        for j, (name, mean, std) in enumerate(zip(self.numeric_names, self.numeric_mean, self.numeric_std)):
            col = np.array([p.numeric.get(name, mean) for p in products], dtype=np.float64)
            out[:, j] = np.clip((col - mean) / std, -NUMERIC_CLIP, NUMERIC_CLIP)
        return out

    def categorical_matrix(self, products: Sequence[ProductRecord]) -> np.ndarray:
        """int64 [N, C]: vocabulary ids; 0 for a missing or unseen value."""
        out = np.zeros((len(products), len(self.categorical_names)), dtype=np.int64)
        for j, (name, vocab) in enumerate(zip(self.categorical_names, self.categorical_vocabs)):
            index = {v: i + 1 for i, v in enumerate(vocab)}
            out[:, j] = [index.get(p.categorical.get(name, ""), 0) for p in products]
        return out

    def class_ids(self, labels: Sequence[str | None]) -> np.ndarray:
        """int64 [n]: class index, IGNORE_INDEX for no label or a class the schema does not know."""
        index = {c: i for i, c in enumerate(self.class_names)}
        return np.array([index.get(lbl, IGNORE_INDEX) if lbl else IGNORE_INDEX for lbl in labels], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"numeric_names": list(self.numeric_names), "numeric_mean": list(self.numeric_mean),
                "numeric_std": list(self.numeric_std), "categorical_names": list(self.categorical_names),
                "categorical_vocabs": [list(v) for v in self.categorical_vocabs],
                "class_names": list(self.class_names)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Schema:
        try:
            return cls(numeric_names=tuple(values["numeric_names"]),
                       numeric_mean=tuple(float(x) for x in values["numeric_mean"]),
                       numeric_std=tuple(float(x) for x in values["numeric_std"]),
                       categorical_names=tuple(values["categorical_names"]),
                       categorical_vocabs=tuple(tuple(v) for v in values["categorical_vocabs"]),
                       class_names=tuple(values["class_names"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInputError(f"invalid schema ({exc!r}); rerun prepare to rebuild it") from None

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        if not Path(path).is_file():
            raise BadInputError(f"schema {path} not found; run `python -m pipeline_steps prepare` for this run dir")
        return cls.from_dict(read_json(path))
