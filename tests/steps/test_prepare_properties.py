"""Property: no input a data owner can upload makes `prepare`'s reader or validator raise.

Generated records (plausible fields holding any JSON value: huge integers, NaN, lone surrogates,
deep nesting) and raw bytes are written as JSON Lines and read the way `prepare` reads them.
Every record read is kept or quarantined with a documented reason, and kept records survive
the rest of prepare (schema, tokenisation, the holdout hash, Parquet).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline_steps import feature_schema, prepared_data, preparing, record_reading, tokenization
from pipeline_steps.config import get_preset

CFG = get_preset("tiny").data
TOKENIZER = tokenization.train_tokenizer(["grey sofa", "oak table", "lamp"], CFG.vocab_size)

# Any character, lone surrogates included (st.text() leaves them out by default).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
scalars = (st.none() | st.booleans() | st.integers(min_value=-10**400, max_value=10**400)
           | st.floats(allow_nan=True, allow_infinity=True) | any_text | st.sampled_from(["P1", "P2", " ", ""]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(any_text | st.sampled_from(["price", "brand"]), inner, max_size=3),
                           max_leaves=8)
product_like = st.fixed_dictionaries({}, optional={k: json_values for k in
                                                   ("id", "title", "description", "numeric", "categorical",
                                                    "category")})
pair_like = st.fixed_dictionaries({}, optional={k: json_values for k in ("query", "product_id", "weight", "label")})


def _as_line(record: dict) -> bytes:
    # Python's encoder writes NaN/Infinity, unbounded integers and \ud800 escapes: what other tools emit.
    return json.dumps(record).encode("ascii")


def lines(records: st.SearchStrategy) -> st.SearchStrategy[list[bytes]]:
    deep = st.integers(min_value=1, max_value=5000).map(lambda n: b"[" * n + b"]" * n)
    return st.lists(records.map(_as_line) | st.binary(max_size=40) | deep, max_size=12)


def _num_records(raw_lines: list[bytes]) -> int:
    """Records in the file: non-blank lines (a raw chunk may hold line breaks of its own)."""
    file_lines = (b"\n".join(raw_lines) + b"\n").split(b"\n")
    file_lines[0] = file_lines[0].removeprefix(b"\xef\xbb\xbf")  # a byte-order mark opens the file only
    return sum(1 for line in file_lines if line.strip())


def _read(kind: str, raw_lines: list[bytes], product_rows: dict[str, int]):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kind}.jsonl"
        path.write_bytes(b"\n".join(raw_lines) + b"\n")
        quarantine = preparing.Quarantine()
        if kind == "products":
            kept, num_read = preparing.read_products([path], CFG, quarantine)
        else:
            counter = Counter()
            kept = [q for chunk in preparing.iter_pair_chunks([path], CFG, product_rows, quarantine, counter, chunk_size=4)
                    for q in chunk.queries]
            num_read = counter["pairs"]
    return kept, num_read, quarantine


def _check_accounting(kind: str, raw_lines: list[bytes], kept: list, num_read: int, quarantine: preparing.Quarantine):
    assert num_read == _num_records(raw_lines)
    assert len(kept) + quarantine.count(kind) == num_read
    assert {e["reason"] for e in quarantine.entries} <= set(record_reading.QUARANTINE_REASONS)
    assert all(e["detail"] for e in quarantine.entries)
    # The quarantine file is written as ASCII JSON: every entry must serialise.
    assert all(json.dumps(e).isascii() for e in quarantine.entries)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(lines(product_like))
def test_any_product_line_is_kept_or_quarantined_with_a_documented_reason(raw_lines):
    kept, num_read, quarantine = _read("products", raw_lines, {})
    _check_accounting("products", raw_lines, kept, num_read, quarantine)
    # What was kept goes through the rest of prepare without an exception.
    schema = feature_schema.Schema.fit(kept)
    products = preparing.build_products(kept, TOKENIZER, schema, CFG)
    with tempfile.TemporaryDirectory() as tmp:
        prepared_data.save_products(Path(tmp) / "products.parquet", products)


@SETTINGS
@given(lines(pair_like))
def test_any_pair_line_is_kept_or_quarantined_with_a_documented_reason(raw_lines):
    queries, num_read, quarantine = _read("pairs", raw_lines, {"P1": 0, "P2": 1})
    _check_accounting("pairs", raw_lines, queries, num_read, quarantine)
    tokenization.holdout_mask(queries, CFG.holdout_fraction, seed=0)
    tokenization.encode_texts(TOKENIZER, queries, CFG.query_length)


def test_the_documented_reasons_are_the_reasons_prepare_uses():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    documented = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    assert set(record_reading.QUARANTINE_REASONS) <= documented
