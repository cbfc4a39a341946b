"""WANDS (the Wayfair ANnotation DataSet, MIT licence) in the pipeline's upload layout.

    git clone https://github.com/wayfair/WANDS && python -m benchmarks.wands WANDS/dataset runs/wands-upload

Reads product.csv, query.csv and label.csv (tab-separated) and writes OUT/products/part-00000.jsonl
(title = product_name, description = product_description, numeric = the rating and review counts,
categorical = product_class, category = the first level of the category hierarchy),
OUT/pairs/part-00000.jsonl (one pair per "Exact" judgement: the annotators' "this product is what
the query asks for") and OUT/_SUCCESS. The converted data is not committed: fetch it from the source.
Source: https://github.com/wayfair/WANDS (Chen et al., "WANDS: Dataset for Product Search Relevance
Assessment", ECIR 2022).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any, Iterator

NUMERIC = ("rating_count", "average_rating", "review_count")


def _rows(path: Path) -> Iterator[dict[str, str]]:
    csv.field_size_limit(sys.maxsize)  # some descriptions are long
    with path.open(encoding="utf-8", newline="") as fh:
        yield from csv.DictReader(fh, delimiter="\t")


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def product_record(row: dict[str, str]) -> dict[str, Any]:
    hierarchy = row.get("category hierarchy") or row.get("category_hierarchy") or ""
    record = {"id": row["product_id"], "title": (row.get("product_name") or "").strip(),
              "description": (row.get("product_description") or "").strip(),
              "numeric": {name: _number(row.get(name)) for name in NUMERIC},
              "categorical": {"product_class": row.get("product_class") or None}}
    if hierarchy.strip():
        record["category"] = hierarchy.split("/")[0].strip()
    return record


def convert(dataset: Path, out: Path) -> dict[str, int]:
    queries = {row["query_id"]: row["query"] for row in _rows(dataset / "query.csv")}
    (out / "products").mkdir(parents=True, exist_ok=True)
    (out / "pairs").mkdir(parents=True, exist_ok=True)
    counts = {"products": 0, "pairs": 0}
    with (out / "products" / "part-00000.jsonl").open("w", encoding="utf-8") as fh:
        for row in _rows(dataset / "product.csv"):
            fh.write(json.dumps(product_record(row)) + "\n")
            counts["products"] += 1
    with (out / "pairs" / "part-00000.jsonl").open("w", encoding="utf-8") as fh:
        for row in _rows(dataset / "label.csv"):
            if row["label"] == "Exact":
                fh.write(json.dumps({"query": queries[row["query_id"]], "product_id": row["product_id"]}) + "\n")
                counts["pairs"] += 1
    (out / "_SUCCESS").write_text("")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wands", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path, help="WANDS's dataset/ folder (product.csv, query.csv, label.csv)")
    parser.add_argument("out", type=Path, help="the upload layout to write")
    args = parser.parse_args(argv)
    print(json.dumps(convert(args.dataset, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
