"""pipeline_steps.batch_validation: whole batches validated at once give exactly what the
per-record validators give, record by record (kept records, reasons, details, line numbers)."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline_steps import batch_validation, record_reading, record_validation
from pipeline_steps.__main__ import main as cli
from pipeline_steps.config import get_preset
from pipeline_steps.demo_data import generate

MAX_CHARS = get_preset("tiny").data.max_text_chars
LONG = "x" * (MAX_CHARS + 1)

# One of each class of bad product a Parquet file can hold (the column types are fixed per file).
BAD_PRODUCTS = [
    {"id": None, "title": "lamp"},  # missing field
    {"id": "  ", "title": "lamp"},  # empty text
    {"id": LONG, "title": "lamp"},  # text too long
    {"id": "b1", "title": None},  # missing field
    {"id": "b2", "title": " \t "},  # empty text
    {"id": "b3", "title": LONG},  # text too long
    {"id": "b4", "title": "lamp", "description": LONG},  # text too long
    {"id": "b5", "title": "lamp", "category": LONG},  # text too long
    {"id": "b6", "title": "lamp", "numeric": {"price": math.nan}},  # non-finite number
    {"id": "b7", "title": "lamp", "numeric": {"price": math.inf}},  # non-finite number
    # Valid, but not the common shape: kept by the per-record path.
    {"id": "ok1", "title": "  lamp \n shade ", "description": "   ", "category": " "},
    {"id": "ok2", "title": "lamp", "categorical": {"brand": "  "}},
]
BAD_PAIRS = [
    {"query": None, "product_id": "P000001"},  # missing field
    {"query": "   ", "product_id": "P000001"},  # empty text
    {"query": LONG, "product_id": "P000001"},  # text too long
    {"query": "sofa", "product_id": None},  # missing field
    {"query": "sofa", "product_id": " "},  # empty text
    {"query": "sofa", "product_id": LONG},  # text too long
    {"query": "sofa", "product_id": "P000001", "weight": 0.0},  # non-positive weight
    {"query": "sofa", "product_id": "P000001", "weight": -1.5},  # non-positive weight
    {"query": "sofa", "product_id": "P000001", "weight": math.nan},  # non-finite number
    {"query": "sofa", "product_id": "P000001", "weight": math.inf},  # non-finite number
    {"query": "sofa", "product_id": "P000001", "label": LONG},  # text too long
    # Valid, but not the common shape: kept by the per-record path.
    {"query": " grey \t sofa ", "product_id": "P000001", "label": "  "},
    {"query": "sofa", "product_id": "P000001", "label": " Living  room "},
]


def _interleave(good: list[dict], bad: list[dict]) -> list[dict]:
    out = list(good)
    for k, record in enumerate(bad):
        out.insert(3 * k + 1, record)
    return out


def _reference(kind: str, files: list[Path], max_chars: int = MAX_CHARS) -> tuple[list, list]:
    """The per-record path: data.iter_records + data.validate_product / validate_pair."""
    validate = record_validation.validate_product if kind == "products" else record_validation.validate_pair
    kept, rejected = [], []
    for raw in record_reading.iter_records(files):
        if raw.reason:
            rejected.append((raw.source, raw.line, raw.reason, raw.detail or "", raw.raw_text()))
            continue
        try:
            record = validate(raw.value, max_chars, raw.source, raw.line)
        except record_validation.RecordError as exc:
            rejected.append((raw.source, raw.line, exc.reason, exc.detail, raw.raw_text()))
        else:
            kept.append(record if kind == "products" else (raw.line, record.query, record.product_id,
                                                            record.weight, record.label))
    return kept, rejected


def _batched(kind: str, files: list[Path], batch_rows: int, max_chars: int = MAX_CHARS) -> tuple[list, list]:
    kept, rejected = [], []
    for batch in record_reading.iter_batches(files, batch_rows):
        if kind == "products":
            valid, bad = batch_validation.validate_products(batch, max_chars)
            kept += [product for _, product in valid]
        else:
            pairs, bad = batch_validation.validate_pairs(batch, max_chars)
            kept += [(batch.lines[i], q, p, w, lbl) for i, q, p, w, lbl in
                     zip(pairs.index, pairs.queries, pairs.product_ids, pairs.weights, pairs.labels)]
        assert [r.index for r in bad] == sorted(r.index for r in bad)
        rejected += [(batch.source, batch.lines[r.index], r.reason, r.detail, batch.raw_record(r.index).raw_text())
                     for r in bad]
    return kept, rejected


def _parquet(path: Path, records: list[dict], schema: pa.Schema | None = None) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    # pa.array infers the columns from every record (Table.from_pylist would use the first one's keys).
    table = pa.Table.from_pylist(records, schema) if schema else pa.Table.from_batches(
        [pa.RecordBatch.from_struct_array(pa.array(records))])
    pq.write_table(table, path)
    return [path]


def _jsonl(path: Path, records: list[dict]) -> list[Path]:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # NaN/Infinity as Python writes them
    return [path]


@pytest.fixture(scope="module")
def demo():
    return generate(30, 2, seed=3)


@pytest.mark.parametrize("write", [_parquet, _jsonl], ids=["parquet", "jsonl"])
@pytest.mark.parametrize("batch_rows", [5, 8192])
def test_batches_validate_exactly_like_the_per_record_validators(tmp_path, demo, write, batch_rows):
    products, pairs = demo
    for kind, records in (("products", _interleave(products, BAD_PRODUCTS)), ("pairs", _interleave(pairs, BAD_PAIRS))):
        files = write(tmp_path / f"{kind}.x", records)
        kept, rejected = _batched(kind, files, batch_rows)
        assert (kept, rejected) == _reference(kind, files)
        assert len(rejected) == len(BAD_PRODUCTS if kind == "products" else BAD_PAIRS) - 2  # 2 odd but valid


# Parquet files whose column types the fast path does not take: every row goes the per-record way.
ODD_TYPES = {
    "int id": ("products", [{"id": 7, "title": "lamp"}], None),
    "map features": ("products", [{"id": "a", "title": "lamp", "numeric": [("price", 2.0), ("w", None)],
                                   "categorical": [("brand", "oak")]}],
                     pa.schema([("id", pa.string()), ("title", pa.string()),
                                ("numeric", pa.map_(pa.string(), pa.float64())),
                                ("categorical", pa.map_(pa.string(), pa.string()))])),
    "int features": ("products", [{"id": "a", "title": "lamp", "numeric": {"reviews": 3},
                                   "categorical": {"size": 42}}], None),
    "int weight": ("pairs", [{"query": "sofa", "product_id": "P1", "weight": 2},
                             {"query": "sofa", "product_id": "P1", "weight": 0}], None),
    # Beyond 2**53 an integer has no exact float64: both paths round it as float(int) does.
    "huge int weight": ("pairs", [{"query": "sofa", "product_id": "P1", "weight": 2**53 + 1},
                                  {"query": "sofa", "product_id": "P1", "weight": 3}], None),
    "huge int feature": ("products", [{"id": "a", "title": "lamp", "numeric": {"reviews": 2**63 - 1}}], None),
    "string weight": ("pairs", [{"query": "sofa", "product_id": "P1", "weight": "2"}], None),
    "bool weight": ("pairs", [{"query": "sofa", "product_id": "P1", "weight": True}], None),
    "int label": ("pairs", [{"query": "sofa", "product_id": "P1", "label": 3}], None),
    "dictionary query": ("pairs", [{"query": "sofa", "product_id": "P1"}],
                         pa.schema([("query", pa.dictionary(pa.int32(), pa.string())), ("product_id", pa.string())])),
}


@pytest.mark.parametrize("case", sorted(ODD_TYPES))
def test_unexpected_parquet_column_types_give_the_per_record_result(tmp_path, case):
    kind, records, schema = ODD_TYPES[case]
    files = _parquet(tmp_path / f"{kind}.parquet", records, schema)
    assert _batched(kind, files, 8192) == _reference(kind, files)


def test_prepare_of_a_dirty_parquet_upload_equals_the_per_record_path(tmp_path, demo, monkeypatch):
    """The whole step, twice on the same Parquet upload: with the vectorised checks, and with
    every row sent through the per-record validators. Kept records, quarantine (entries, order,
    reasons) and every output are byte-identical."""
    products, pairs = demo
    data = tmp_path / "upload"
    _parquet(data / "products" / "part-0.parquet", _interleave(products, BAD_PRODUCTS))
    _parquet(data / "pairs" / "part-0.parquet", _interleave(pairs, BAD_PAIRS))
    args = ["--data", str(data), "--max-bad-fraction", "0.9"]
    assert cli(["prepare", "--run-dir", str(tmp_path / "vectorised"), *args]) == 0

    def per_record(batch, max_chars, valid, slow):
        slow.extend(range(len(batch)))

    monkeypatch.setattr(batch_validation, "_arrow_products", per_record)
    monkeypatch.setattr(batch_validation, "_arrow_pairs", per_record)
    assert cli(["prepare", "--run-dir", str(tmp_path / "per-record"), *args]) == 0
    fast, slow = tmp_path / "vectorised" / "prepared", tmp_path / "per-record" / "prepared"
    quarantine = (fast / "quarantine.jsonl").read_text()
    assert quarantine.count("\n") == len(BAD_PRODUCTS) + len(BAD_PAIRS) - 4
    for name in ("quarantine.jsonl", "products.parquet", "train_pairs.parquet", "holdout_pairs.parquet",
                 "schema.json", "tokenizer.json"):
        assert (fast / name).read_bytes() == (slow / name).read_bytes(), name


# Any UTF-8 text (Parquet cannot hold lone surrogates), whitespace of every kind, a few lengths
# around the limit of 4 characters the property uses.
texts = st.none() | st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(["", " ", "\u3000", "abcd"])
floats = st.none() | st.floats(allow_nan=True, allow_infinity=True)
pair_rows = st.lists(st.fixed_dictionaries({"query": texts, "product_id": texts},
                                           optional={"weight": floats, "label": texts}), min_size=1, max_size=12)
product_rows = st.lists(st.fixed_dictionaries(
    {"id": texts, "title": texts},
    optional={"description": texts, "category": texts,
              "numeric": st.none() | st.fixed_dictionaries({"price": floats}, optional={"": floats}),
              "categorical": st.none() | st.fixed_dictionaries({"brand": texts})}),
    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["products", "pairs"]).flatmap(
    lambda kind: st.tuples(st.just(kind), product_rows if kind == "products" else pair_rows)))
def test_any_parquet_batch_validates_exactly_like_the_per_record_validators(tmp_path, case):
    kind, records = case
    files = _parquet(tmp_path / f"{kind}.parquet", records)
    assert _batched(kind, files, 5, max_chars=4) == _reference(kind, files, max_chars=4)


# JSON Lines hold any JSON value in any field.
json_values = texts | floats | st.integers(min_value=-10**30, max_value=10**30) | st.booleans() \
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=4)
json_pairs = st.lists(st.fixed_dictionaries({"query": texts, "product_id": texts},
                                            optional={"weight": json_values, "label": json_values}), max_size=12)
json_products = st.lists(st.fixed_dictionaries(
    {"id": texts, "title": texts},
    optional={"description": json_values, "category": json_values,
              "numeric": st.none() | st.dictionaries(st.sampled_from(["price", ""]), json_values, max_size=2),
              "categorical": st.none() | st.dictionaries(st.sampled_from(["brand", ""]), json_values, max_size=2)}),
    max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["products", "pairs"]).flatmap(
    lambda kind: st.tuples(st.just(kind), json_products if kind == "products" else json_pairs)))
def test_any_json_lines_batch_validates_exactly_like_the_per_record_validators(tmp_path, case):
    kind, records = case
    files = _jsonl(tmp_path / f"{kind}.jsonl", records)
    assert _batched(kind, files, 5, max_chars=4) == _reference(kind, files, max_chars=4)
