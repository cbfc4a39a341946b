"""Generated uploads of shapes unlike the demo catalog, for measuring `prepare` (bench.bench_prepare).

Each generator writes `num_records` JSON Lines records (1 product : 4 pairs, as the demo) into
OUT/products/part-*.jsonl and OUT/pairs/part-*.jsonl, 8 shards each, deterministic for its seed:

  short-5k-vocab     short titles and descriptions over a 5,000-word vocabulary, queries of 2-4
                     of those words (every query nearly distinct)
  long-descriptions  descriptions of 120-300 words (1-3 KB of text per product)
  large-vocabulary   words drawn (skewed) from 500,000 distinct words, in products and queries
  distinct-queries   every query distinct: words, model numbers and sizes (no query repeats)
  non-ascii          Latin with accents, Cyrillic, Greek, CJK and emoji in every text field
Words are made of syllables by numpy and joined by Arrow, so a million records take seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

SHARDS = 8
PAIRS_PER_PRODUCT = 4

_LATIN = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "en", "ar", "dul", "bri", "ost", "pel", "qu", "zan")
_ACCENTED = tuple("\u00e9\u00fc\u00f1\u00f8\u00e5\u00e7\u00df\u0151\u017e\u0142\u00e0\u00ee")
_CYRILLIC = tuple(("\u043a\u0430 \u043b\u043e \u043c\u0438 \u043d\u0435 \u0440\u0443 \u0442\u0430 \u0432\u043e "
                   "\u0448\u0438 \u0435\u043d \u0430\u0440 \u0434\u0443\u043b\u044c \u0431\u0440\u0438").split())
_GREEK = tuple(("\u03ba\u03b1 \u03bb\u03bf \u03bc\u03b9 \u03bd\u03b5 \u03c1\u03c5 \u03c4\u03b1 \u03b2\u03bf "
                "\u03c3\u03b9 \u03b5\u03bd \u03b1\u03c1").split())
_CJK = tuple("\u5317\u4eac\u4e1c\u897f\u5357\u5c71\u6c34\u6728\u706b\u571f\u91d1\u65e5\u6708\u661f\u4e91"
             "\u96e8\u98ce\u82b1\u8349\u9e1f\u9c7c\u9a6c\u725b\u7f8a\u732b\u72d7\u8f66\u8239\u4e66\u7b14")
_EMOJI = ("\U0001F6CB", "\U0001F45F", "\U0001F4BB", "\u2615", "\u2B50", "\U0001F525")


def _words(rng: np.random.Generator, count: int, syllables: tuple[str, ...], min_syl: int = 1,
           max_syl: int = 5) -> pa.Array:
    """`count` distinct words of `min_syl`-`max_syl` random syllables, in random order."""
    candidates = 3 * count
    lengths = rng.integers(min_syl, max_syl + 1, candidates)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    parts = pa.array(syllables, pa.string()).take(pa.array(rng.integers(0, len(syllables), int(offsets[-1]))))
    words = pc.unique(pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), parts), ""))
    assert len(words) >= count, f"{len(syllables)} syllables make fewer than {count} words"
    return words.take(pa.array(rng.permutation(len(words))[:count]))


def _texts(rng: np.random.Generator, vocab: pa.Array, count: int, low: int, high: int, skew: float = 1.0) -> pa.Array:
    """`count` texts of `low`-`high` words of `vocab`: word k drawn with probability falling as
    k^(1/skew - 1) (uniform at skew 1; at skew 3 the first of 20,000 words is 4% of all)."""
    lengths = rng.integers(low, high + 1, count)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    picks = (len(vocab) * rng.random(int(offsets[-1])) ** skew).astype(np.int64)
    return pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), vocab.take(pa.array(picks))), " ")


def _catalog(rng: np.random.Generator, num_products: int, titles: pa.Array, descriptions: pa.Array,
             brands: pa.Array) -> list[dict]:
    ids = [f"SKU-{i:08d}" for i in range(num_products)]
    price = np.round(rng.lognormal(3.5, 1.0, num_products), 2).tolist()
    rating = np.round(rng.uniform(1.0, 5.0, num_products), 1).tolist()
    brand = brands.take(pa.array(rng.integers(0, len(brands), num_products))).to_pylist()
    category = rng.integers(0, 40, num_products).tolist()
    return [{"id": i, "title": t, "description": d, "numeric": {"price": p, "rating": r},
             "categorical": {"brand": b}, "category": f"dept-{c}"}
            for i, t, d, p, r, b, c in zip(ids, titles.to_pylist(), descriptions.to_pylist(), price, rating,
                                           brand, category)]


def _pairs(rng: np.random.Generator, num_products: int, queries: pa.Array) -> list[dict]:
    """PAIRS_PER_PRODUCT pairs per product, shuffled; one in five has weight 2.0."""
    product = rng.permutation(np.repeat(np.arange(num_products), PAIRS_PER_PRODUCT))
    purchase = (rng.random(len(product)) < 0.2).tolist()
    return [{"query": q, "product_id": f"SKU-{p:08d}", **({"weight": 2.0} if w else {})}
            for q, p, w in zip(queries.to_pylist(), product.tolist(), purchase)]


def short_5k_vocab(rng: np.random.Generator, n: int) -> tuple[list[dict], list[dict]]:
    vocab = _words(rng, 5_000, _LATIN)
    return (_catalog(rng, n, _texts(rng, vocab, n, 3, 8), _texts(rng, vocab, n, 6, 20), vocab[:200]),
            _pairs(rng, n, _texts(rng, vocab, n * PAIRS_PER_PRODUCT, 2, 4)))


def long_descriptions(rng: np.random.Generator, n: int) -> tuple[list[dict], list[dict]]:
    vocab = _words(rng, 20_000, _LATIN)
    return (_catalog(rng, n, _texts(rng, vocab, n, 4, 10), _texts(rng, vocab, n, 120, 300, skew=3.0), vocab[:500]),
            _pairs(rng, n, _texts(rng, vocab, n * PAIRS_PER_PRODUCT, 1, 4, skew=3.0)))


def large_vocabulary(rng: np.random.Generator, n: int) -> tuple[list[dict], list[dict]]:
    vocab = _words(rng, 500_000, _LATIN, 2, 6)
    return (_catalog(rng, n, _texts(rng, vocab, n, 4, 10, skew=3.0), _texts(rng, vocab, n, 10, 40, skew=3.0),
                     vocab[:5_000]),
            _pairs(rng, n, _texts(rng, vocab, n * PAIRS_PER_PRODUCT, 2, 5, skew=3.0)))


def distinct_queries(rng: np.random.Generator, n: int) -> tuple[list[dict], list[dict]]:
    vocab = _words(rng, 50_000, _LATIN)
    words = _texts(rng, vocab, n * PAIRS_PER_PRODUCT, 2, 5)
    # A unique model number per query: no two queries are the same text.
    numbers = pa.array([f"m{i:07d} {s}cm" for i, s in enumerate(rng.integers(10, 300, len(words)).tolist())])
    return (_catalog(rng, n, _texts(rng, vocab, n, 4, 10), _texts(rng, vocab, n, 10, 30), vocab[:1_000]),
            _pairs(rng, n, pc.binary_join_element_wise(words, numbers, " ")))


def non_ascii(rng: np.random.Generator, n: int) -> tuple[list[dict], list[dict]]:
    scripts = [_words(rng, 5_000, tuple(s + a for s in _LATIN for a in ("", *_ACCENTED))),
               _words(rng, 5_000, _CYRILLIC), _words(rng, 3_000, _GREEK), _words(rng, 3_000, _CJK, 2, 4),
               _words(rng, 50, _EMOJI, 1, 3)]
    vocab = pa.concat_arrays(scripts)
    return (_catalog(rng, n, _texts(rng, vocab, n, 3, 8), _texts(rng, vocab, n, 8, 25), scripts[0][:300]),
            _pairs(rng, n, _texts(rng, vocab, n * PAIRS_PER_PRODUCT, 2, 4)))


GENERATORS: dict[str, Callable[[np.random.Generator, int], tuple[list[dict], list[dict]]]] = {
    "short-5k-vocab": short_5k_vocab, "long-descriptions": long_descriptions, "large-vocabulary": large_vocabulary,
    "distinct-queries": distinct_queries, "non-ascii": non_ascii,
}


def write_upload(name: str, out: Path, num_records: int, seed: int = 0) -> int:
    """The `name` generator's upload of about `num_records` records in OUT (products/, pairs/);
    returns the number of records written."""
    num_products = max(num_records // (1 + PAIRS_PER_PRODUCT), 10)
    products, pairs = GENERATORS[name](np.random.default_rng(seed), num_products)
    for kind, records in (("products", products), ("pairs", pairs)):
        (out / kind).mkdir(parents=True)
        size = -(-len(records) // SHARDS)
        for i in range(SHARDS):
            with open(out / kind / f"part-{i:05d}.jsonl", "wb") as fh:
                fh.writelines(orjson.dumps(r) + b"\n" for r in records[i * size:(i + 1) * size])
    return len(products) + len(pairs)
