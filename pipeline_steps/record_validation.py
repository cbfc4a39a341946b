"""Validating one input record: a product or a pair, with the reason a bad one is quarantined.
The record schemas: docs/data.md, "Inputs". (batch_validation.py checks whole batches against these.)"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class RecordError(ValueError):
    """A record that fails validation: `reason` is a stable category (counted in prepare.json),
    `detail` says exactly what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)  # built once per record: slots make that ~2x cheaper than frozen
class ProductRecord:
    id: str
    title: str
    description: str | None = None
    numeric: dict[str, float] = field(default_factory=dict)
    categorical: dict[str, str] = field(default_factory=dict)
    category: str | None = None
    source: str = ""
    line: int = 0

    @property
    def text(self) -> str:
        """The product text the encoder and BM25 see: title, then description."""
        return self.title if not self.description else f"{self.title} {self.description}"


@dataclass(slots=True)  # built once per record: slots make that ~2x cheaper than frozen
class PairRecord:
    query: str
    product_id: str
    weight: float = 1.0
    label: str | None = None
    source: str = ""
    line: int = 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_float(value: Any, name: str) -> float:
    """`value` (a JSON/Parquet number) as a finite float, or RecordError saying why not."""
    if not _is_number(value):
        raise RecordError("wrong type", f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)  # Python ints are unbounded: 10**400 has no float
    except OverflowError:
        raise RecordError("number out of range", f"{name} does not fit a 64-bit float") from None
    if not math.isfinite(number):
        raise RecordError("non-finite number", f"{name} is {number}")
    return number


_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def collapse_spaces(text: str) -> str:
    """`" ".join(text.split())`: words separated by single spaces, none at either end. A long text
    that already is so (most descriptions) is returned as it is, found by scans that run in C
    instead of splitting it into words: ASCII without control characters has no whitespace but
    the space."""
    if len(text) > 64 and text.isascii() and not text.encode("ascii").translate(None, _PRINTABLE_ASCII) \
            and "  " not in text and text[0] != " " and text[-1] != " ":
        return text
    return " ".join(text.split())


def _text(record: dict, name: str, max_chars: int, *, required: bool) -> str | None:
    """A text field, whitespace-collapsed; None when optional and absent/empty."""
    value = record.get(name)
    if value is None:
        if required:
            raise RecordError("missing field", f"missing field {name!r}")
        return None
    if not isinstance(value, str):
        raise RecordError("wrong type", f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise RecordError("text too long", f"{name} has {len(value)} characters (max_text_chars is {max_chars})")
    value = collapse_spaces(value)
    if not value:
        if required:
            raise RecordError("empty text", f"{name} is empty")
        return None
    return value


def _identifier(record: dict, name: str, max_chars: int) -> str:
    # Ids are matched exactly (pairs -> products), so unlike text they are not normalised.
    value = record.get(name)
    if value is None:
        raise RecordError("missing field", f"missing field {name!r}")
    if not isinstance(value, str):
        raise RecordError("wrong type", f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty text", f"{name} is empty")
    if len(value) > max_chars:
        raise RecordError("text too long", f"{name} has {len(value)} characters (max_text_chars is {max_chars})")
    return value


def _mapping(record: dict, name: str) -> dict[str, Any]:
    value = record.get(name)
    if value is None:
        return {}
    if isinstance(value, list):  # a Parquet map column reads back as a list of (key, value) tuples
        if not all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
            raise RecordError("wrong type", f"{name} must be an object of name -> value")
        value = dict(value)
    if not isinstance(value, dict):
        raise RecordError("wrong type", f"{name} must be an object of name -> value, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str) or not key:
            raise RecordError("wrong type", f"{name} has a non-string or empty feature name {key!r}")
    return value


def _numeric_features(record: dict) -> dict[str, float]:
    features = {}
    # A None value (a Parquet struct without that field, or JSON null) is a missing feature.
    for key, value in _mapping(record, "numeric").items():
        if value is None:
            continue
        features[key] = _finite_float(value, f"numeric.{key}")
    return features


def _categorical_features(record: dict) -> dict[str, str]:
    features = {}
    for key, value in _mapping(record, "categorical").items():
        if value is None:
            continue
        # Integer codes are common in exported catalogs; they are category names, not quantities.
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        elif isinstance(value, float) and value.is_integer():
            value = str(int(value))
        if not isinstance(value, str):
            raise RecordError("wrong type", f"categorical.{key} must be a string, got {type(value).__name__}")
        if value.strip():
            features[key] = value.strip()
    return features


def validate_product(record: dict, max_chars: int, source: str = "", line: int = 0) -> ProductRecord:
    """A ProductRecord, or RecordError saying why the record is unusable."""
    return ProductRecord(
        id=_identifier(record, "id", max_chars),
        title=_text(record, "title", max_chars, required=True),
        description=_text(record, "description", max_chars, required=False),
        numeric=_numeric_features(record),
        categorical=_categorical_features(record),
        category=_text(record, "category", max_chars, required=False),
        source=source,
        line=line,
    )


def validate_pair(record: dict, max_chars: int, source: str = "", line: int = 0) -> PairRecord:
    """A PairRecord, or RecordError saying why the record is unusable."""
    # The common case in a few checks (pairs are the bulk of the input); anything else takes the
    # field-by-field path below, which gives the reason.
    query, product_id, weight = record.get("query"), record.get("product_id"), record.get("weight")
    if (type(query) is str and type(product_id) is str and record.get("label") is None
            and (weight is None or (type(weight) is float and 0.0 < weight < math.inf))
            and len(query) <= max_chars and len(product_id) <= max_chars and not product_id.isspace() and product_id):
        text = " ".join(query.split())
        if text:
            return PairRecord(text, product_id, 1.0 if weight is None else weight, None, source, line)
    weight = record.get("weight")
    if weight is None:
        weight = 1.0
    weight = _finite_float(weight, "weight")
    if weight <= 0:
        raise RecordError("non-positive weight", f"weight must be > 0, got {weight}")
    return PairRecord(
        query=_text(record, "query", max_chars, required=True),
        product_id=_identifier(record, "product_id", max_chars),
        weight=float(weight),
        label=_text(record, "label", max_chars, required=False),
        source=source,
        line=line,
    )
