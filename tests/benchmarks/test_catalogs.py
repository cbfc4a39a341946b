"""benchmarks/catalogs.py: each generator writes an upload of the shape it names, the same for a seed."""

from __future__ import annotations

import orjson

from benchmarks.catalogs import GENERATORS, write_upload


def _records(upload, kind):
    return [orjson.loads(line) for path in sorted((upload / kind).glob("*.jsonl")) for line in path.open("rb")]


def test_each_generator_writes_its_shape_in_eight_shards(tmp_path):
    shapes = {}
    for name in GENERATORS:
        written = write_upload(name, tmp_path / name, 2_000)
        products, pairs = _records(tmp_path / name, "products"), _records(tmp_path / name, "pairs")
        assert written == len(products) + len(pairs) == 2_000 and len(pairs) == 4 * len(products), name
        assert len(list((tmp_path / name / "pairs").glob("*.jsonl"))) == 8
        ids = {p["id"] for p in products}
        assert len(ids) == len(products) and all(pair["product_id"] in ids for pair in pairs)
        words = [w for p in products for w in f"{p['title']} {p['description']}".split()]
        queries = [pair["query"] for pair in pairs]
        shapes[name] = {"words_per_product": len(words) / len(products), "distinct_words": len(set(words)),
                        "distinct_queries": len(set(queries)) / len(queries),
                        "non_ascii": sum(not q.isascii() for q in queries) / len(queries)}
    assert shapes["long-descriptions"]["words_per_product"] > 100 and shapes["short-5k-vocab"]["words_per_product"] < 30
    assert shapes["large-vocabulary"]["distinct_words"] > 2 * shapes["short-5k-vocab"]["distinct_words"]
    assert shapes["distinct-queries"]["distinct_queries"] == 1.0
    assert shapes["non-ascii"]["non_ascii"] > 0.9 and shapes["short-5k-vocab"]["non_ascii"] == 0


def test_a_generator_is_deterministic_for_its_seed(tmp_path):
    for out in ("a", "b"):
        write_upload("non-ascii", tmp_path / out, 500, seed=3)
    for kind in ("products", "pairs"):
        for path in (tmp_path / "a" / kind).glob("*.jsonl"):
            assert path.read_bytes() == (tmp_path / "b" / kind / path.name).read_bytes()
