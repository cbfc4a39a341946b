"""The bundled demo data: layout, size per preset, determinism, and structure word overlap cannot solve."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from pipeline_steps import record_reading, record_validation
from pipeline_steps.config import get_preset
from pipeline_steps.demo_data import COLOURS, TYPES, generate, write_demo


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_written_in_the_upload_layout_with_both_formats(tmp_path):
    out = write_demo(tmp_path / "demo", "tiny", seed=0)
    files = _files(out)
    assert "_SUCCESS" in files
    assert any(re.fullmatch(r"products/part-\d{5}\.jsonl", f) for f in files)
    assert any(re.fullmatch(r"pairs/part-\d{5}\.parquet", f) for f in files)
    preset = get_preset("tiny")
    products = list(record_reading.iter_records(record_reading.list_input_files(out / "products")))
    pairs = list(record_reading.iter_records(record_reading.list_input_files(out / "pairs")))
    assert len(products) == preset.demo_products
    assert len(pairs) == preset.demo_products * preset.demo_queries_per_product
    # Every record is valid input: the demo never trips the quarantine.
    for r in products:
        record_validation.validate_product(r.value, 4096)
    for r in pairs:
        record_validation.validate_pair(r.value, 4096)


def test_same_seed_same_bytes_other_seed_other_data(tmp_path):
    a = _files(write_demo(tmp_path / "a", "tiny", seed=0))
    assert a == _files(write_demo(tmp_path / "b", "tiny", seed=0))
    assert a != _files(write_demo(tmp_path / "c", "tiny", seed=1))


def test_rewriting_a_smaller_demo_removes_stale_shards(tmp_path):
    write_demo(tmp_path / "d", "small", seed=0)
    write_demo(tmp_path / "d", "tiny", seed=0)
    assert _files(tmp_path / "d") == _files(write_demo(tmp_path / "e", "tiny", seed=0))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


@pytest.fixture(scope="module")
def demo():
    products, pairs = generate(400, 4, seed=0)
    return {p["id"]: p for p in products}, pairs


def test_queries_need_more_than_word_overlap(demo):
    products, pairs = demo
    overlaps = []
    for pair in pairs:
        p = products[pair["product_id"]]
        doc = _words(p["title"] + " " + p.get("description", ""))
        overlaps.append(len(_words(pair["query"]) & doc) / len(_words(pair["query"])))
    # Most queries share words with their product (learnable), but a real share have little or
    # none (synonyms, typos, paraphrases), which BM25 alone cannot match.
    assert sum(o >= 0.5 for o in overlaps) / len(overlaps) > 0.5
    assert sum(o < 0.5 for o in overlaps) / len(overlaps) > 0.15
    synonyms = {s for t in TYPES for s in t.synonyms} | {s for _, syns in COLOURS for s in syns}
    assert any(s in pair["query"] for pair in pairs for s in synonyms)
    assert any(q in pair["query"] for pair in pairs for q in ("cheap", "budget", "premium", "luxury"))


def test_every_product_has_same_family_distractors_in_other_colours(demo):
    products, _ = demo
    families = defaultdict(set)
    for p in products.values():
        c = p["categorical"]
        families[(p["category"], c["brand"], c["material"], c["size"])].add(c["colour"])
    with_siblings = sum(len(colours) >= 2 for colours in families.values())
    assert with_siblings / len(families) > 0.8
    assert all(set(p["numeric"]) >= {"price", "reviews"} and p["category"] for p in products.values())
    assert any("rating" not in p["numeric"] for p in products.values())  # a missing numeric feature


def test_a_catalog_larger_than_the_distinct_combinations_is_generated():
    from pipeline_steps.demo_data import generate_products

    products = generate_products(12_000, seed=0)  # more than the 11,760 (type, brand, ..., colour) combinations
    assert len({p["id"] for p in products}) == 12_000
    assert any(p["title"].endswith(" Mk 2") for p in products)
