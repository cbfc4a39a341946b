"""Validating a batch of input records at once, with the per-record validators as the reference.

`validate_products` / `validate_pairs` take a `data.RecordBatch` and return what
`data.validate_product` / `data.validate_pair` give record by record, only faster: JSON Lines'
common record shape passes a few inline checks; Parquet columns are checked with Arrow compute.
Any record a check flags (and every row of a column of an unexpected type) goes through the
per-record validator, which gives its reason. A library used by `prepare`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import record_reading, record_validation

PRODUCT_TEXTS = ("title", "description", "category")
"""Product text fields: whitespace-collapsed, at most max_text_chars; title required."""


@dataclass
class Rejected:
    index: int
    """Position of the record in its batch."""
    reason: str
    detail: str


@dataclass
class ValidPairs:
    """The valid pairs of a batch, as columns, with each pair's position in the batch."""

    index: list[int] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    product_ids: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    labels: list[str | None] = field(default_factory=list)

    def subset(self, keep: list[int]) -> ValidPairs:
        """The pairs at positions `keep` of this batch's valid pairs."""
        return ValidPairs(*([values[k] for k in keep] for values in (self.index, self.queries, self.product_ids,
                                                                     self.weights, self.labels)))

    def add(self, i: int, pair: record_validation.PairRecord) -> None:
        self.index.append(i)
        self.queries.append(pair.query)
        self.product_ids.append(pair.product_id)
        self.weights.append(pair.weight)
        self.labels.append(pair.label)


def _slow_path(batch: record_reading.RecordBatch, indices: list[int], validate, max_chars: int,
               accept, rejected: list[Rejected]) -> None:
    """The per-record validator on the records at `indices`: `accept(i, record)` or a Rejected."""
    for i, value in zip(indices, batch.rows(indices)):
        failed = batch.failed.get(i)
        if failed is not None:
            rejected.append(Rejected(i, failed.reason, failed.detail or ""))
            continue
        try:
            record = validate(value, max_chars, batch.source, batch.lines[i])
        except record_validation.RecordError as exc:
            rejected.append(Rejected(i, exc.reason, exc.detail))
        else:
            accept(i, record)


# ---------------------------------------------------------------------------------------------
# Pairs
# ---------------------------------------------------------------------------------------------

def validate_pairs(batch: record_reading.RecordBatch, max_chars: int) -> tuple[ValidPairs, list[Rejected]]:
    """The valid pairs of `batch` (in order) and the rejected records (sorted by index)."""
    valid, rejected, slow = ValidPairs(), [], []
    if batch.values is None:
        _arrow_pairs(batch, max_chars, valid, slow)
    else:
        _inline_pairs(batch, max_chars, valid, slow)
    if slow:
        found = ValidPairs()
        _slow_path(batch, slow, record_validation.validate_pair, max_chars, found.add, rejected)
        valid = _merge_pairs(valid, found)
    return valid, rejected


def _inline_pairs(batch: record_reading.RecordBatch, max_chars: int, valid: ValidPairs, slow: list[int]) -> None:
    """The shape most pairs have ({"query": str, "product_id": str, "weight": float?}) in a few
    checks: the same conditions as data.validate_pair's own shortcut."""
    index, queries, product_ids, weights, labels = (valid.index, valid.queries, valid.product_ids, valid.weights,
                                                    valid.labels)
    for i, record in enumerate(batch.values):
        if record is None:
            slow.append(i)
            continue
        query, product_id, weight = record.get("query"), record.get("product_id"), record.get("weight")
        if (type(query) is str and type(product_id) is str and record.get("label") is None
                and (weight is None or (type(weight) is float and 0.0 < weight < math.inf))
                and len(query) <= max_chars and len(product_id) <= max_chars and product_id
                and not product_id.isspace()):
            text = " ".join(query.split())
            if text:
                index.append(i)
                queries.append(text)
                product_ids.append(product_id)
                weights.append(1.0 if weight is None else weight)
                labels.append(None)
                continue
        slow.append(i)


def _merge_pairs(a: ValidPairs, b: ValidPairs) -> ValidPairs:
    if not a.index:
        return b
    order = sorted(range(len(a.index) + len(b.index)), key=(a.index + b.index).__getitem__)
    columns = {name: getattr(a, name) + getattr(b, name) for name in ("index", "queries", "product_ids",
                                                                      "weights", "labels")}
    return ValidPairs(**{name: [values[k] for k in order] for name, values in columns.items()})


def _column(table: pa.RecordBatch, name: str) -> pa.Array | None:
    index = table.schema.get_field_index(name)
    return None if index < 0 else table.column(index)


def _is_string(array: pa.Array | None) -> bool:
    return array is not None and (pa.types.is_string(array.type) or pa.types.is_large_string(array.type))


def _within(array: pa.Array, max_chars: int) -> np.ndarray:
    """bool [n]: non-null and at most max_chars code points."""
    return pc.fill_null(pc.less_equal(pc.utf8_length(array), max_chars), False).to_numpy(zero_copy_only=False)


def _texts(array: pa.Array, rows: np.ndarray) -> list[str | None]:
    """The whitespace-collapsed texts at `rows` (None stays None), as data._text makes them."""
    return [None if v is None else record_validation.collapse_spaces(v) for v in array.take(pa.array(rows)).to_pylist()]


def _numbers(array: pa.Array | None) -> pa.Array | None:
    """A numeric column as float64 (None: absent, or of a type the per-record path must judge)."""
    if array is None or not (pa.types.is_floating(array.type) or pa.types.is_integer(array.type)):
        return None
    # Unsafe: an integer beyond 2**53 rounds as float(int) does on the per-record path (a safe cast raises).
    return pc.cast(array, pa.float64(), safe=False)


def _arrow_pairs(batch: record_reading.RecordBatch, max_chars: int, valid: ValidPairs, slow: list[int]) -> None:
    table = batch.table
    n = table.num_rows
    query, product_id = _column(table, "query"), _column(table, "product_id")
    weight, label = _column(table, "weight"), _column(table, "label")
    if not (_is_string(query) and _is_string(product_id)) or (label is not None and not _is_string(label)) \
            or (weight is not None and weight.null_count < n and _numbers(weight) is None):
        slow.extend(range(n))
        return
    ok = _within(query, max_chars) & _within(product_id, max_chars)
    if label is not None:
        ok &= label.is_null().to_numpy(zero_copy_only=False) | _within(label, max_chars)
    weights = np.ones(n)
    if weight is not None and weight.null_count < n:
        numbers = _numbers(weight)
        values = pc.fill_null(numbers, 1.0).to_numpy(zero_copy_only=False)
        ok &= np.isfinite(values) & (values > 0)  # NaN fails both
        weights = values
    rows = np.flatnonzero(ok)
    texts = _texts(query, rows)
    ids = product_id.take(pa.array(rows)).to_pylist()
    labels = _texts(label, rows) if label is not None else [None] * len(rows)
    for k, i in enumerate(rows.tolist()):
        text, pid, lbl = texts[k], ids[k], labels[k]
        # Empty after collapsing, a blank id or a blank label: the per-record path decides.
        if not text or not pid or pid.isspace() or lbl == "":
            slow.append(i)
            continue
        valid.index.append(i)
        valid.queries.append(text)
        valid.product_ids.append(pid)
        valid.weights.append(float(weights[i]))
        valid.labels.append(lbl)
    slow.extend(np.flatnonzero(~ok).tolist())
    slow.sort()


# ---------------------------------------------------------------------------------------------
# Products
# ---------------------------------------------------------------------------------------------

def validate_products(batch: record_reading.RecordBatch, max_chars: int) -> tuple[list[tuple[int, record_validation.ProductRecord]], list[Rejected]]:
    """(index, ProductRecord) of the valid products of `batch` (in order), and the rejected
    records (sorted by index)."""
    valid: list[tuple[int, record_validation.ProductRecord]] = []
    rejected: list[Rejected] = []
    slow: list[int] = []
    if batch.values is None:
        _arrow_products(batch, max_chars, valid, slow)
    else:
        for i, record in enumerate(batch.values):
            product = None if record is None else _inline_product(record, max_chars, batch.source, batch.lines[i])
            if product is None:
                slow.append(i)
            else:
                valid.append((i, product))
    if slow:
        found: list[tuple[int, record_validation.ProductRecord]] = []
        _slow_path(batch, slow, record_validation.validate_product, max_chars, lambda i, p: found.append((i, p)), rejected)
        valid = sorted(valid + found, key=lambda item: item[0])
    return valid, rejected


def _optional_text(value: Any, max_chars: int) -> str | None | bool:
    """data._text of an optional field: the text or None; False when the per-record path must judge."""
    if value is None:
        return None
    if type(value) is not str or len(value) > max_chars:
        return False
    return record_validation.collapse_spaces(value) or None


def _numeric(value: Any) -> dict[str, float] | None:
    """data._numeric_features of the common shape (float values); None: the per-record path judges."""
    if value is None:
        return {}
    if type(value) is not dict:
        return None
    features = {}
    for key, number in value.items():
        if type(key) is not str or not key:
            return None
        if number is None:
            continue
        if type(number) is not float or not math.isfinite(number):
            return None
        features[key] = number
    return features


def _categorical(value: Any) -> dict[str, str] | None:
    """data._categorical_features of the common shape (string values); None: the per-record path judges."""
    if value is None:
        return {}
    if type(value) is not dict:
        return None
    features = {}
    for key, text in value.items():
        if type(key) is not str or not key:
            return None
        if text is None:
            continue
        if type(text) is not str:
            return None
        text = text.strip()
        if text:
            features[key] = text
    return features


def _inline_product(record: dict, max_chars: int, source: str, line: int) -> record_validation.ProductRecord | None:
    """data.validate_product of a well-formed record; None for anything else (including bad records)."""
    product_id, title = record.get("id"), record.get("title")
    if type(product_id) is not str or type(title) is not str or not product_id or product_id.isspace() \
            or len(product_id) > max_chars or len(title) > max_chars:
        return None
    title = record_validation.collapse_spaces(title)
    description = _optional_text(record.get("description"), max_chars)
    category = _optional_text(record.get("category"), max_chars)
    numeric, categorical = _numeric(record.get("numeric")), _categorical(record.get("categorical"))
    if not title or description is False or category is False or numeric is None or categorical is None:
        return None
    return record_validation.ProductRecord(product_id, title, description, numeric, categorical, category, source, line)


def _arrow_products(batch: record_reading.RecordBatch, max_chars: int, valid: list[tuple[int, record_validation.ProductRecord]],
                    slow: list[int]) -> None:
    """Vectorised checks of the scalar columns (id, title, description, category); the feature
    columns (structs or maps) are read row by row only for the rows that pass."""
    table = batch.table
    n = table.num_rows
    ids, texts = _column(table, "id"), {name: _column(table, name) for name in PRODUCT_TEXTS}
    if not _is_string(ids) or not _is_string(texts["title"]) or any(
            array is not None and not _is_string(array) for array in texts.values()):
        slow.extend(range(n))
        return
    ok = _within(ids, max_chars) & _within(texts["title"], max_chars)
    for name in ("description", "category"):
        if texts[name] is not None:
            ok &= texts[name].is_null().to_numpy(zero_copy_only=False) | _within(texts[name], max_chars)
    rows = np.flatnonzero(ok)
    take = pa.array(rows)
    product_ids = ids.take(take).to_pylist()
    columns = {name: _texts(array, rows) if array is not None else [None] * len(rows) for name, array in texts.items()}
    features = {name: (_column(table, name).take(take).to_pylist() if _column(table, name) is not None
                       else [None] * len(rows)) for name in ("numeric", "categorical")}
    for k, i in enumerate(rows.tolist()):
        numeric, categorical = _numeric(features["numeric"][k]), _categorical(features["categorical"][k])
        product_id, title = product_ids[k], columns["title"][k]
        if (not title or not product_id or product_id.isspace() or numeric is None or categorical is None
                or columns["description"][k] == "" or columns["category"][k] == ""):
            slow.append(i)
            continue
        valid.append((i, record_validation.ProductRecord(product_id, title, columns["description"][k] or None, numeric, categorical,
                                         columns["category"][k] or None, batch.source, batch.lines[i])))
    slow.extend(np.flatnonzero(~ok).tolist())
    slow.sort()
