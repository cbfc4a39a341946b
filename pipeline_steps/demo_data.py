"""Bundled demo data: a seeded product catalog and search queries, in the upload layout.

Writes OUT_DIR/products/part-*.jsonl, OUT_DIR/pairs/part-*.parquet and, last, OUT_DIR/_SUCCESS; the
same (preset, seed) gives byte-identical files. What the data holds: docs/data.md, "Demo data".

    python -m pipeline_steps.demo_data OUT_DIR [--preset tiny] [--seed 0]
    python -m pipeline_steps prepare --run-dir DIR --demo     # writes it into DIR/input/, then prepares it
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .config import Preset, get_preset
from .fileio import atomic_path, atomic_write_bytes


@dataclass(frozen=True)
class _Type:
    name: str
    synonyms: tuple[str, ...]
    department: str
    paraphrases: tuple[str, ...]
    materials: tuple[str, ...]
    sizes: tuple[str, ...]
    base_price: float


TYPES: tuple[_Type, ...] = (
    _Type("sofa", ("couch", "settee"), "furniture", ("living room seating", "somewhere to sit for three"),
          ("leather", "velvet", "linen"), ("2-seat", "3-seat", "corner"), 600.0),
    _Type("armchair", ("easy chair", "lounge chair"), "furniture", ("single seat for reading", "cosy reading seat"),
          ("leather", "velvet", "linen"), ("standard", "wide"), 300.0),
    _Type("desk", ("writing table", "workstation"), "furniture", ("table for working from home", "home office table"),
          ("oak", "walnut", "steel"), ("compact", "standard", "large"), 250.0),
    _Type("lamp", ("light", "luminaire"), "lighting", ("bedside lighting", "reading light"),
          ("brass", "ceramic", "glass"), ("table", "floor"), 60.0),
    _Type("rug", ("carpet", "mat"), "home", ("floor covering", "something soft for the floor"),
          ("wool", "jute", "cotton"), ("small", "medium", "large"), 120.0),
    _Type("mug", ("cup", "beaker"), "kitchen", ("something to drink coffee from", "tea vessel"),
          ("ceramic", "glass", "enamel"), ("300ml", "450ml"), 12.0),
    _Type("kettle", ("water boiler", "tea kettle"), "kitchen", ("boil water for tea", "hot water maker"),
          ("steel", "glass"), ("1l", "1.7l"), 40.0),
    _Type("sneakers", ("trainers", "running shoes"), "footwear", ("shoes for jogging", "sporty shoes"),
          ("mesh", "leather", "canvas"), ("uk 7", "uk 9", "uk 11"), 80.0),
    _Type("jacket", ("coat", "parka"), "apparel", ("warm outerwear for winter", "something warm to wear outside"),
          ("wool", "cotton", "nylon"), ("s", "m", "l", "xl"), 110.0),
    _Type("t-shirt", ("tee", "top"), "apparel", ("short sleeve shirt", "casual summer shirt"),
          ("cotton", "linen"), ("s", "m", "l", "xl"), 20.0),
    _Type("backpack", ("rucksack", "daypack"), "bags", ("bag to carry a laptop", "school bag"),
          ("nylon", "canvas", "leather"), ("20l", "30l"), 70.0),
    _Type("headphones", ("earphones", "headset"), "electronics", ("listen to music privately", "noise free audio"),
          ("plastic", "aluminium"), ("on-ear", "over-ear"), 90.0),
    _Type("television", ("tv", "smart tv"), "electronics", ("screen for watching films", "big screen for the lounge"),
          ("plastic", "aluminium"), ("43 inch", "55 inch", "65 inch"), 500.0),
    _Type("laptop", ("notebook", "ultrabook"), "electronics", ("portable computer", "computer for travel"),
          ("aluminium", "plastic"), ("13 inch", "15 inch"), 900.0),
)

# (colour, synonyms a shopper might type instead)
COLOURS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grey", ("gray", "charcoal")), ("black", ("jet black",)), ("white", ("ivory",)),
    ("navy", ("dark blue",)), ("red", ("crimson",)), ("green", ("olive",)), ("beige", ("sand", "cream")),
    ("brown", ("chocolate",)), ("pink", ("blush",)), ("yellow", ("mustard",)),
)
# (brand, price multiplier): the tier makes price a learnable function of brand and material.
BRANDS: tuple[tuple[str, float], ...] = (
    ("Nordvik", 1.0), ("Aurelo", 1.8), ("Kestrel", 0.6), ("Maplewood", 1.3), ("Solenne", 2.2),
    ("Brixton", 0.8), ("Vantor", 1.1), ("Luma", 0.5), ("Oakhaven", 1.5), ("Tessaro", 2.5),
    ("Pinecrest", 0.7), ("Zephyr", 1.2),
)
MATERIAL_PRICE = {"leather": 1.6, "velvet": 1.3, "walnut": 1.5, "oak": 1.3, "brass": 1.4, "wool": 1.3,
                  "aluminium": 1.2, "linen": 1.1}
CHEAP_WORDS = ("cheap", "budget", "affordable")
PREMIUM_WORDS = ("premium", "luxury", "high end")
QUERY_KINDS = ("exact", "synonym", "typo", "paraphrase", "attribute", "price")
NUM_PRODUCT_SHARDS = 2
NUM_PAIR_SHARDS = 2


def _typo(word: str, rng: random.Random) -> str:
    """One realistic keyboard slip in the longest word: drop, double or swap a letter (never the first)."""
    parts = word.split(" ")
    if len(parts) > 1:
        j = max(range(len(parts)), key=lambda k: len(parts[k]))
        parts[j] = _typo(parts[j], rng)
        return " ".join(parts)
    if len(word) < 4:
        return word
    i = rng.randrange(1, len(word) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        return word[:i] + word[i + 1:]
    if kind == 1:
        return word[:i] + word[i] + word[i:]
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def _price(t: _Type, brand_mult: float, material: str, size_index: int, rng: random.Random) -> float:
    raw = t.base_price * brand_mult * MATERIAL_PRICE.get(material, 1.0) * (1.0 + 0.25 * size_index)
    return round(raw * math.exp(rng.gauss(0.0, 0.15)), 2)


def _families(rng: random.Random):
    """Endless (type, brand, material, size) families; each is sold in several colours."""
    while True:
        t = rng.choice(TYPES)
        brand, mult = rng.choice(BRANDS)
        material = rng.choice(t.materials)
        size_index = rng.randrange(len(t.sizes))
        yield t, brand, mult, material, size_index


def _title(t: _Type, type_word: str, brand: str, colour: str, material: str, size: str, rng: random.Random) -> str:
    templates = (
        f"{brand} {colour.title()} {material.title()} {type_word.title()}",
        f"{brand} {type_word.title()} in {colour} {material}, {size}",
        f"{type_word.title()} - {colour.title()} {material} - {brand}",
        f"{colour.title()} {type_word} by {brand} ({size})",
    )
    return rng.choice(templates)


def _description(t: _Type, type_word: str, material: str, size: str, rng: random.Random) -> str | None:
    # Some products have no description: the reader treats it as optional.
    if rng.random() < 0.3:
        return None
    return rng.choice((
        f"A {size} {type_word} made of {material}.",
        f"{size.title()} {material} {type_word}. Ideal as {rng.choice(t.paraphrases)}.",
        f"Our {material} {type_word}, {size}, with free delivery and a two year warranty.",
    ))


def generate_products(num_products: int, seed: int) -> list[dict]:
    """`num_products` product records (docs/data.md, "Demo data"), deterministic for `seed`."""
    rng = random.Random(f"products:{seed}")
    seen: set[tuple] = set()
    # Distinct (type, brand, material, size, colour) products; a larger catalog repeats them as
    # model series ("... Mk 2"), so any size terminates.
    capacity = sum(len(t.materials) * len(t.sizes) for t in TYPES) * len(BRANDS) * len(COLOURS)
    series = 1
    products: list[dict] = []
    families = _families(rng)
    while len(products) < num_products:
        if len(seen) == capacity:
            seen.clear()
            series += 1
        t, brand, mult, material, size_index = next(families)
        size = t.sizes[size_index]
        # 2-4 colour variants of one family: the hard distractors of each other.
        for colour, _ in rng.sample(COLOURS, rng.randint(2, 4)):
            key = (t.name, brand, material, size, colour)
            if key in seen or len(products) >= num_products:
                continue
            seen.add(key)
            # A third of the titles use a synonym, so the canonical query word is absent from them.
            type_word = rng.choice(t.synonyms) if rng.random() < 0.35 else t.name
            reviews = int(rng.lognormvariate(3.0, 1.2)) if rng.random() < 0.9 else 0
            numeric: dict[str, float] = {"price": _price(t, mult, material, size_index, rng),
                                         "reviews": float(reviews)}
            if reviews:  # a product nobody reviewed has no rating: exercises a missing numeric feature
                numeric["rating"] = round(min(5.0, max(1.0, rng.gauss(3.6 + 0.3 * mult, 0.5))), 1)
            record = {
                "id": f"P{len(products):06d}",
                "title": _title(t, type_word, brand, colour, material, size, rng) + (f" Mk {series}" if series > 1 else ""),
                "numeric": numeric,
                "categorical": {"brand": brand, "colour": colour, "material": material, "size": size},
                "category": t.department,
                "_type": t.name,  # generator-only bookkeeping, removed before writing
                "_type_word": type_word,
            }
            description = _description(t, type_word, material, size, rng)
            if description is not None:
                record["description"] = description
            products.append(record)
    return products


def _price_band(products: list[dict]) -> dict[str, tuple[float, float]]:
    """Per product type: the (33rd, 67th) price percentiles that "cheap" and "premium" refer to."""
    by_type: dict[str, list[float]] = {}
    for p in products:
        by_type.setdefault(p["_type"], []).append(p["numeric"]["price"])
    bands = {}
    for name, prices in by_type.items():
        prices.sort()
        bands[name] = (prices[len(prices) // 3], prices[(2 * len(prices)) // 3])
    return bands


def _query(kind: str, p: dict, t: _Type, band: tuple[float, float], rng: random.Random) -> str:
    cat = p["categorical"]
    colour, material, brand, size = cat["colour"], cat["material"], cat["brand"].lower(), cat["size"]
    colour_syn = rng.choice(dict(COLOURS)[colour])
    # The type word the title does NOT use: the canonical name if the title used a synonym, else a synonym.
    other_word = t.name if p["_type_word"] != t.name else rng.choice(t.synonyms)
    price = p["numeric"]["price"]
    if kind == "price" and (price <= band[0] or price >= band[1]):
        words = CHEAP_WORDS if price <= band[0] else PREMIUM_WORDS
        return f"{rng.choice(words)} {colour} {other_word}"
    if kind == "synonym":
        return f"{colour_syn} {material} {other_word}"
    if kind == "typo":
        parts = [colour, material, p["_type_word"]]
        j = max(range(3), key=lambda k: len(parts[k]))
        parts[j] = _typo(parts[j], rng)
        return " ".join(parts)
    if kind == "paraphrase":
        return f"{rng.choice(t.paraphrases)} in {colour}"
    if kind == "attribute":
        return rng.choice((f"{brand} {colour} {size}", f"{colour} {material} {brand}"))
    return rng.choice((f"{colour} {material} {p['_type_word']}", f"{brand} {colour} {p['_type_word']}"))


def generate_pairs(products: list[dict], queries_per_product: int, seed: int) -> list[dict]:
    """`queries_per_product` (query, product_id) pairs per product, mixing the query kinds."""
    rng = random.Random(f"pairs:{seed}")
    types = {t.name: t for t in TYPES}
    bands = _price_band(products)
    pairs: list[dict] = []
    for p in products:
        kinds = rng.sample(QUERY_KINDS, min(queries_per_product, len(QUERY_KINDS)))
        kinds += [rng.choice(QUERY_KINDS) for _ in range(queries_per_product - len(kinds))]
        for kind in kinds:
            pair: dict = {"query": _query(kind, p, types[p["_type"]], bands[p["_type"]], rng), "product_id": p["id"]}
            if rng.random() < 0.2:  # a purchase counts more than a click; weight is optional
                pair["weight"] = 2.0
            pairs.append(pair)
    rng.shuffle(pairs)
    return pairs


def generate(num_products: int, queries_per_product: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(product records, pair records) in the input schema of `pipeline_steps.record_validation`."""
    products = generate_products(num_products, seed)
    pairs = generate_pairs(products, queries_per_product, seed)
    public = [{k: v for k, v in p.items() if not k.startswith("_")} for p in products]
    return public, pairs


def _shards(records: list[dict], count: int) -> list[list[dict]]:
    size = math.ceil(len(records) / count)
    return [records[i * size:(i + 1) * size] for i in range(count)]


def write_demo(out_dir: str | Path, preset: Preset | str = "tiny", seed: int = 0) -> Path:
    """Write the demo dataset for `preset` into `out_dir` (upload layout); return `out_dir`."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    out = Path(out_dir)
    products, pairs = generate(preset.demo_products, preset.demo_queries_per_product, seed)
    (out / "_SUCCESS").unlink(missing_ok=True)
    for sub in ("products", "pairs"):  # stale shards of an earlier, larger demo would be read too
        for old in (out / sub).glob("part-*"):
            old.unlink()
    # Products as JSON Lines and pairs as Parquet: one demo run exercises both readers.
    for i, shard in enumerate(_shards(products, NUM_PRODUCT_SHARDS)):
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in shard)
        atomic_write_bytes(out / "products" / f"part-{i:05d}.jsonl", text.encode("ascii"))
    schema = pa.schema([("query", pa.string()), ("product_id", pa.string()), ("weight", pa.float64())])
    for i, shard in enumerate(_shards(pairs, NUM_PAIR_SHARDS)):
        with atomic_path(out / "pairs" / f"part-{i:05d}.parquet") as tmp:
            pq.write_table(pa.Table.from_pylist(shard, schema=schema), tmp)
    atomic_write_bytes(out / "_SUCCESS", b"")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps.demo_data", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_demo(args.out_dir, args.preset, args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
