"""`python -m benchmarks.wands`: WANDS's three tab-separated files become an upload `prepare` reads.
The sample rows below are in WANDS's published layout (its README and dataset/*.csv headers)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.wands import convert
from pipeline_steps import data as data_lib

PRODUCTS = [
    ["product_id", "product_name", "product_class", "category hierarchy", "product_description",
     "product_features", "rating_count", "average_rating", "review_count"],
    ["0", "solid wood platform bed", "Beds", "Furniture / Bedroom Furniture / Beds & Headboards / Beds",
     "good, deep sleep can be quite difficult", "overallwidth-sidetoside:64.7|dsprimaryproductstyle:modern", "15",
     "4.5", "15"],
    ["1", "all-clad 7 qt . slow cooker", "Slow Cookers", "", "", "capacityquarts:7", "", "", ""],
]
QUERIES = [["query_id", "query", "query_class"], ["0", "salon chair", "Massage Chairs"],
           ["1", "smart coffee table", "Coffee & Cocktail Tables"]]
LABELS = [["id", "query_id", "product_id", "label"], ["0", "0", "0", "Irrelevant"], ["1", "0", "1", "Partial"],
          ["2", "1", "0", "Exact"], ["3", "1", "1", "Exact"]]


def _write(path: Path, rows: list[list[str]]) -> None:
    path.write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")


def test_exact_judgements_become_pairs_and_products_keep_their_features(tmp_path: Path) -> None:
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    for name, rows in (("product.csv", PRODUCTS), ("query.csv", QUERIES), ("label.csv", LABELS)):
        _write(dataset / name, rows)
    assert convert(dataset, tmp_path / "upload") == {"products": 2, "pairs": 2}

    products = [json.loads(line) for line in (tmp_path / "upload/products/part-00000.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (tmp_path / "upload/pairs/part-00000.jsonl").read_text().splitlines()]
    assert pairs == [{"query": "smart coffee table", "product_id": "0"},
                     {"query": "smart coffee table", "product_id": "1"}]  # Partial and Irrelevant are not pairs
    bed, cooker = (data_lib.validate_product(p, max_chars=4096) for p in products)  # what prepare checks
    assert products[0]["category"] == "Furniture" and "category" not in products[1]
    assert products[0]["numeric"] == {"rating_count": 15.0, "average_rating": 4.5, "review_count": 15.0}
    assert products[1]["numeric"] == {"rating_count": None, "average_rating": None, "review_count": None}
    assert products[0]["categorical"] == {"product_class": "Beds"} and bed.title == "solid wood platform bed"
    assert cooker.title == "all-clad 7 qt . slow cooker"
    assert (tmp_path / "upload/_SUCCESS").is_file()
