"""`prepare` as an AWS Batch array job, in three phases that write the same RUN_DIR/prepared/ as a
single `prepare`: the plan (checksums, the catalog, the tokenizer trained once, the pair input cut
into units that depend on the input only), one shard per array child (validates and tokenises its
units, each into its own files, with a sidecar written last), and the finish (merges the counts and
the quarantine, applies --max-bad-fraction, fixes the classes and assembles the outputs in unit
order). Any shard count gives byte-identical outputs; finished units are skipped on a rerun.
How and why: docs/data.md, "Scale: prepare as an array job".

Local:  python -m pipeline_steps prepare --phase plan --run-dir runs/r1 --data path/to/upload --preset small
        python -m pipeline_steps prepare --phase shard --run-dir runs/r1 --shard-index 0 --shard-count 4  (x4)
        python -m pipeline_steps prepare --phase finish --run-dir runs/r1
AWS:    the Prepare, PrepareShards (array) and PrepareFinish states (docs/orchestration.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline_contract import PREPARE_REPORT, PREPARED_DIR

from . import feature_schema, prepared_data, preparing, record_reading, tokenization, upload_readiness
from .config import DataConfig, from_dict, to_dict
from .errors import BadInputError, StepError
from .fileio import atomic_path, atomic_write_bytes, atomic_write_json, read_json, sha256_file
from .shards import remove_stale_temps, resolve_shard, shard_bounds

log = logging.getLogger("pipeline_steps.prepare")

SHARDS = "_shards"
PLAN = "plan.json"
PLAN_FORMAT_VERSION = 1
UNIT_BYTES = 32 * 2**20
"""JSON Lines bytes per unit (cut at the next line start). A unit is the smallest piece a child
owns: 10^8 pairs of ~100 bytes are ~300 units, enough for hundreds of children."""
PLAN_SAMPLE_PAIRS = 2_000_000
"""Pair records the plan reads at most for the tokenizer sample (whole units, in hash order)."""
SIDES = ("train", "holdout")
UNIT_SCHEMA = pa.schema([("query", pa.string()), ("product_index", pa.int64()), ("token_ids", pa.list_(pa.int32())),
                         ("length", pa.int32()), ("weight", pa.float32()), ("label", pa.string()),
                         ("key", pa.uint64())])
"""A unit's pairs: tokenised, with the label as text (its class id needs the final schema) and the
query key (distinct queries in the report)."""


def shards_dir(run_dir: Path) -> Path:
    return Path(run_dir) / PREPARED_DIR / SHARDS


# ---------------------------------------------------------------------------------------------
# Units: the pieces of the pair input
# ---------------------------------------------------------------------------------------------

def _line_starts(path: Path, unit_bytes: int) -> list[int]:
    """0, the first line start at or after every multiple of unit_bytes, and the file size."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as fh:
        for target in range(unit_bytes, size, unit_bytes):
            if target <= bounds[-1]:
                continue  # a line longer than a unit: the previous cut is past this target
            fh.seek(target - 1)
            fh.readline()  # the rest of the line that holds byte target-1
            if fh.tell() < size:
                bounds.append(fh.tell())
    return bounds + [size]


def plan_units(files: Sequence[Path], unit_bytes: int | None = None) -> list[dict[str, Any]]:
    """The units of the pair input, in input order: {"source", "format", "start", "end"} with a
    byte range (JSON Lines) or a row group range (Parquet, plus "first_line": its first row number)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    units: list[dict[str, Any]] = []
    for path in files:
        if record_reading.input_format(path) == "parquet":
            meta = record_reading.open_parquet(path).metadata
            row = 0
            for group in range(meta.num_row_groups):
                units.append({"source": str(path), "format": "parquet", "start": group, "end": group + 1,
                              "first_line": row + 1})
                row += meta.row_group(group).num_rows
        elif path.stat().st_size == 0:
            log.warning("input file %s is empty (0 bytes): it adds no records", path)
        else:
            bounds = _line_starts(path, unit_bytes)
            units += [{"source": str(path), "format": "jsonl", "start": a, "end": b} for a, b in zip(bounds, bounds[1:])]
    return units


def unit_batches(unit: dict[str, Any]) -> record_reading.JsonlBatches | Iterator[record_reading.RecordBatch]:
    """The records of one unit in batches, read as `prepare` reads whole files (the same parse and
    quarantine reasons). JSON Lines line numbers count from the unit's first line, and the reader's
    `lines` is the number of lines the unit spans once read, so the finish can number them in the file."""
    if unit["format"] == "parquet":
        return record_reading.parquet_batches(Path(unit["source"]), row_groups=range(unit["start"], unit["end"]),
                                 first_row=unit["first_line"])
    return record_reading.JsonlBatches(Path(unit["source"]), start=unit["start"], end=unit["end"])


def _unit_order(unit: dict[str, Any]) -> bytes:
    return hashlib.blake2b(f"{unit['source']}\x00{unit['start']}".encode(), digest_size=8).digest()


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------

def query_sample(units: Sequence[dict[str, Any]], cfg: DataConfig, product_row: dict[str, int], seed: int,
                 max_pairs: int = PLAN_SAMPLE_PAIRS) -> list[str]:
    """The training queries the tokenizer learns from: whole units, in an order fixed by a hash of
    their names, until `max_pairs` pair records are read (docs/data.md, "The tokenizer is trained once")."""
    sample = preparing.tokenizer_sample()
    threshold = tokenization.holdout_threshold(cfg.holdout_fraction)
    num_read: Counter = Counter()
    with open(os.devnull, "wb") as sink:  # the shards quarantine these records, with their line numbers
        quarantine = preparing.Quarantine(sink)
        for unit in sorted(units, key=_unit_order):
            if num_read["pairs"] >= max_pairs:
                break
            for chunk in preparing.iter_pair_chunks([], cfg, product_row, quarantine, num_read, batches=unit_batches(unit)):
                keys = tokenization.query_keys(chunk.queries, seed)
                sample.update(q for q, key in zip(chunk.queries, keys) if key >= threshold)  # holdout stays unseen
    return sample.texts()


def _plan_id(plan: dict[str, Any]) -> str:
    body = {k: v for k, v in plan.items() if k != "plan_id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def plan(args: argparse.Namespace, preset) -> dict[str, Any]:
    """Validate the catalog, fix the tokenizer and cut the pairs into units; returns plan.json."""
    cfg = preparing.data_config(args, preset)
    out = args.run_dir / PREPARED_DIR
    shards = out / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    (args.run_dir / PREPARE_REPORT).unlink(missing_ok=True)  # a new prepare starts: no old "ok" beside new files
    (shards / PLAN).unlink(missing_ok=True)

    product_files, pair_files = preparing.resolve_inputs(args, args.run_dir, args.seed)
    inputs = {"products": preparing.input_checksums(product_files), "pairs": preparing.input_checksums(pair_files)}
    if args.data is not None:
        upload_readiness.check_checksums(args.data, {i["path"]: i["sha256"] for kind in inputs.values() for i in kind})
    report: dict[str, Any] = {
        "status": "failed", "preset": preset.name, "seed": args.seed, "data_config": to_dict(cfg), "inputs": inputs,
        "input_sha256": preparing.sha256_bytes(json.dumps(inputs, sort_keys=True).encode()),
        "init_from": str(args.init_from) if args.init_from else None,
    }
    quarantine_path = shards / "quarantine.products.jsonl"
    try:
        units = plan_units(pair_files)
        with atomic_path(quarantine_path) as tmp, open(tmp, "wb") as sink:
            quarantine = preparing.Quarantine(sink)
            catalog, num_read = preparing.read_products(product_files, cfg, quarantine)
        counts = {"products": preparing.record_counts("products", num_read, quarantine)}
        # The catalog's check here: a bad catalog fails before any array child starts.
        preparing.check_threshold(counts, cfg.max_bad_fraction, quarantine_path, {"products": product_files})
        product_row = {p.id: i for i, p in enumerate(catalog)}
        reuse = args.init_from is not None or args.pretrained is not None
        sample = [] if reuse else query_sample(units, cfg, product_row, args.seed)
        tokenizer, tokenizer_bytes, schema, origin = preparing.tokenizer_and_schema(
            args.init_from, cfg, catalog, preparing.SpilledPairs([], 0, 0, 0, sample, set()), args.pretrained, out)
        products = preparing.build_products(catalog, tokenizer, schema, cfg)
    except StepError as exc:
        atomic_write_json(args.run_dir / PREPARE_REPORT, {**report, "error": str(exc)})
        raise
    atomic_write_bytes(shards / "tokenizer.json", tokenizer_bytes)
    schema.save(shards / "schema.json")
    prepared_data.save_products(shards / "products.parquet", products, arrays=False)  # the finish writes the arrays
    report.update(product_counts=counts["products"],
                  tokenizer={"source": origin, "sha256": preparing.sha256_bytes(tokenizer_bytes),
                             "vocab_size": tokenizer.get_vocab_size()},
                  schema_coverage=preparing.schema_coverage(schema, catalog, products))
    result = {"format_version": PLAN_FORMAT_VERSION, "units": units, "report": report,
              # With --init-from the schema is the previous model's: pair labels add no classes.
              "schema_fixed": args.init_from is not None,
              "files": {name: sha256_file(shards / name) for name in
                        ("tokenizer.json", "schema.json", "products.parquet", quarantine_path.name)}}
    result["plan_id"] = _plan_id(result)
    atomic_write_json(shards / PLAN, result)
    log.info("plan %s...: %d products, %d units of pairs in %d files; run the shards, then --phase finish",
             result["plan_id"][:12], len(products), len(units), len(pair_files))
    return result


def load_plan(shards: Path) -> dict[str, Any]:
    path = shards / PLAN
    if not path.is_file():
        raise BadInputError(f"{path} is missing: run `python -m pipeline_steps prepare --phase plan --run-dir "
                            f"{shards.parent.parent} --data ...` first (the Prepare state)")
    return read_json(path)


# ---------------------------------------------------------------------------------------------
# Shard: one array child's units
# ---------------------------------------------------------------------------------------------

def unit_paths(shards: Path, unit: int) -> dict[str, Path]:
    stem = shards / "units" / f"unit-{unit:06d}"
    return {"train": Path(f"{stem}.train.parquet"), "holdout": Path(f"{stem}.holdout.parquet"),
            "quarantine": Path(f"{stem}.quarantine.jsonl"), "sidecar": Path(f"{stem}.json")}


def unit_status(shards: Path, plan_id: str, unit: int) -> str | None:
    """None when the unit is complete for this plan; else why it must be (re)done."""
    paths = unit_paths(shards, unit)
    if not paths["sidecar"].is_file():
        return "not written yet"
    try:
        meta = read_json(paths["sidecar"])
    except ValueError:
        return "sidecar unreadable"
    if meta.get("plan_id") != plan_id:
        return "written for another plan"
    for name, expected in meta.get("files", {}).items():
        if not paths[name].is_file() or sha256_file(paths[name]) != expected:
            return f"{paths[name].name} missing or modified"
    return None


def write_unit(shards: Path, plan: dict[str, Any], unit: int, tokenizer, product_row: dict[str, int],
               cfg: DataConfig, seed: int) -> dict[str, Any]:
    """Validate and tokenise one unit into its files (each atomic), then its sidecar."""
    paths = unit_paths(shards, unit)
    for path in paths.values():
        remove_stale_temps(path)
    paths["sidecar"].unlink(missing_ok=True)  # first: a crash below leaves no complete-looking unit
    batches = unit_batches(plan["units"][unit])
    threshold = tokenization.holdout_threshold(cfg.holdout_fraction)
    num_read: Counter = Counter()
    rows: Counter = Counter()
    labels: set[str] = set()
    with contextlib.ExitStack() as stack:
        # Entered after their atomic paths, so each closes before its file is renamed into place.
        sink = stack.enter_context(open(stack.enter_context(atomic_path(paths["quarantine"])), "wb"))
        writers = {side: stack.enter_context(pq.ParquetWriter(stack.enter_context(atomic_path(paths[side])),
                                                              UNIT_SCHEMA)) for side in SIDES}
        quarantine = preparing.Quarantine(sink)
        encoder = tokenization.TextEncoder(tokenizer, cfg.query_length)
        known_keys: dict[str, int] = {}  # queries repeat across chunks
        for chunk in preparing.iter_pair_chunks([], cfg, product_row, quarantine, num_read, batches=batches):
            keys = tokenization.query_keys(chunk.queries, seed, known_keys)
            holdout = keys < threshold
            token_ids, lengths = encoder(chunk.queries)
            labels.update(label for label in chunk.labels if label)
            table = pa.table({"query": pa.array(chunk.queries, pa.string()), "product_index": chunk.product_index,
                              "token_ids": prepared_data._list_column(token_ids), "length": lengths, "weight": chunk.weight,
                              "label": pa.array(chunk.labels, pa.string()), "key": keys}, schema=UNIT_SCHEMA)
            for side, mask in (("train", ~holdout), ("holdout", holdout)):
                if mask.any():
                    writers[side].write_table(table.filter(pa.array(mask)))
                    rows[side] += int(mask.sum())
    # Only JSON Lines units need it: a Parquet unit's rows are numbered from the plan's first_line.
    spanned = batches.lines if isinstance(batches, record_reading.JsonlBatches) else 0
    meta = {"unit": unit, "plan_id": plan["plan_id"], "read": num_read["pairs"], "lines": spanned,
            "rows": {side: rows[side] for side in SIDES}, "reasons": dict(sorted(quarantine.reasons["pairs"].items())),
            "labels": sorted(labels),
            "files": {name: sha256_file(paths[name]) for name in (*SIDES, "quarantine")}}
    atomic_write_json(paths["sidecar"], meta)
    return meta


def run_shard(run_dir: Path, shard_index: int | None, shard_count: int | None) -> dict[str, Any]:
    """Prepare this child's units that are not complete yet."""
    index, count = resolve_shard(shard_index, shard_count)
    shards = shards_dir(run_dir)
    plan_doc = load_plan(shards)
    start, end = shard_bounds(len(plan_doc["units"]), index, count)
    todo = {unit: why for unit in range(start, end) if (why := unit_status(shards, plan_doc["plan_id"], unit))}
    log.info("shard %d/%d: units [%d, %d), %d already complete", index, count, start, end, end - start - len(todo))
    if todo:
        cfg = from_dict(DataConfig, plan_doc["report"]["data_config"])
        tokenizer = tokenization.load_tokenizer(shards / "tokenizer.json")
        ids = pq.read_table(shards / "products.parquet", columns=["id"]).column("id").to_pylist()
        product_row = {product_id: row for row, product_id in enumerate(ids)}
        for unit, why in todo.items():
            t0 = time.monotonic()
            meta = write_unit(shards, plan_doc, unit, tokenizer, product_row, cfg, plan_doc["report"]["seed"])
            log.info("unit %d (%s): %d pairs read, %d train / %d holdout in %.1fs", unit, why, meta["read"],
                     meta["rows"]["train"], meta["rows"]["holdout"], time.monotonic() - t0)
    return {"shard_index": index, "shard_count": count, "units": [start, end], "written": sorted(todo)}


# ---------------------------------------------------------------------------------------------
# Finish
# ---------------------------------------------------------------------------------------------

def _shard_of(unit: int, num_units: int, shard_count: int) -> int:
    return next(i for i in range(shard_count) if unit < shard_bounds(num_units, i, shard_count)[1])


def finished_units(shards: Path, plan_doc: dict[str, Any], shard_count: int | None) -> list[dict[str, Any]]:
    """Every unit's sidecar; BadInputError naming the units (and shards) to rerun when one is not complete."""
    num_units = len(plan_doc["units"])
    bad = {unit: why for unit in range(num_units) if (why := unit_status(shards, plan_doc["plan_id"], unit))}
    if bad:
        listed = ", ".join(f"{unit} ({why})" for unit, why in list(bad.items())[:10])
        rerun = (f"shards {sorted({_shard_of(u, num_units, shard_count) for u in bad})} of {shard_count}"
                 if shard_count else "the shards that own them")
        raise BadInputError(f"{len(bad)} of {num_units} units of the pairs are not prepared: {listed}; rerun "
                            f"`prepare --phase shard --run-dir RUN_DIR --shard-index I --shard-count N` for {rerun} "
                            f"(or the array job), then --phase finish")
    return [read_json(unit_paths(shards, unit)["sidecar"]) for unit in range(num_units)]


def write_quarantine(path: Path, shards: Path, plan_doc: dict[str, Any], metas: Sequence[dict[str, Any]]) -> None:
    """The catalog's bad records, then every unit's, with JSON Lines line numbers counted in the file."""
    lines_before: Counter = Counter()  # source -> lines of its earlier units
    with atomic_path(path) as tmp, open(tmp, "wb") as sink:
        with open(shards / "quarantine.products.jsonl", "rb") as fh:
            shutil.copyfileobj(fh, sink)
        for unit, meta in zip(plan_doc["units"], metas):
            offset = lines_before[unit["source"]] if unit["format"] == "jsonl" else 0
            with open(unit_paths(shards, meta["unit"])["quarantine"], "rb") as fh:
                for line in fh:
                    if offset:
                        entry = json.loads(line)
                        entry["line"] += offset
                        line = json.dumps(entry, sort_keys=True).encode("ascii") + b"\n"  # as Quarantine.add
                    sink.write(line)
            lines_before[unit["source"]] += meta["lines"]


def final_schema(plan_schema: feature_schema.Schema, labels: set[str], fixed: bool) -> feature_schema.Schema:
    """The plan's schema with the pair labels' classes (sorted with the catalog's, as Schema.fit)."""
    if fixed:
        return plan_schema
    return dataclasses.replace(plan_schema, class_names=tuple(sorted(set(plan_schema.class_names) | labels)))


def _remap_classes(class_id: np.ndarray, old: feature_schema.Schema, new: feature_schema.Schema) -> np.ndarray:
    index = {name: i for i, name in enumerate(new.class_names)}
    mapping = np.array([index[name] for name in old.class_names] or [feature_schema.IGNORE_INDEX], dtype=np.int64)
    return np.where(class_id >= 0, mapping[np.maximum(class_id, 0)], class_id).astype(np.int64)


def assemble_pairs(out: Path, shards: Path, metas: Sequence[dict[str, Any]], schema: feature_schema.Schema, cfg: DataConfig,
                   products: prepared_data.Products) -> preparing.PairStats:
    """The pair outputs (prepare.PairOutputs) from the units in unit order, a row group at a time."""
    num_rows = {side: sum(m["rows"][side] for m in metas) for side in SIDES}
    with preparing.PairOutputs(out, num_rows, cfg, products) as outputs:
        for meta in metas:
            paths = unit_paths(shards, meta["unit"])
            for side in SIDES:
                path = paths[side]
                parquet = pq.ParquetFile(path)
                for group in range(parquet.num_row_groups):
                    part = parquet.read_row_group(group)
                    index = part.column("product_index").to_numpy()
                    pairs = prepared_data.Pairs(queries=[], token_ids=prepared_data._matrix(part, "token_ids", cfg.query_length, np.int32, path),
                                    lengths=part.column("length").to_numpy(), product_index=index,
                                    weight=part.column("weight").to_numpy(),
                                    class_id=preparing.pair_class_ids(part.column("label").to_pylist(), index, schema,
                                                              products.class_id))
                    outputs.append(side, part.column("query"), pairs, part.column("key").to_numpy())
    return outputs.stats


def finish(run_dir: Path, shard_count: int | None = None, max_bad_fraction: float | None = None) -> dict[str, Any]:
    """Check every unit, apply the threshold (the plan's, or `max_bad_fraction`: a finish that failed
    on it can be rerun alone with another), write RUN_DIR/prepared/ with prepare.json last."""
    started = time.time()
    out = Path(run_dir) / PREPARED_DIR
    shards = out / SHARDS
    plan_doc = load_plan(shards)
    done = Path(run_dir) / PREPARE_REPORT
    if done.is_file():
        previous = read_json(done)
        if previous.get("status") == "ok" and previous.get("shards", {}).get("plan_id") == plan_doc["plan_id"]:
            log.info("%s is already finished for plan %s...; nothing to do", out, plan_doc["plan_id"][:12])
            return previous
    done.unlink(missing_ok=True)
    metas = finished_units(shards, plan_doc, shard_count)
    cfg = from_dict(DataConfig, plan_doc["report"]["data_config"])
    if max_bad_fraction is not None:
        cfg = dataclasses.replace(cfg, max_bad_fraction=max_bad_fraction)  # validated (BadConfigError)

    # ---- counts, quarantine, threshold
    quarantine = preparing.Quarantine()
    product_counts = plan_doc["report"]["product_counts"]
    quarantine.reasons["products"].update(product_counts["reasons"])
    for meta in metas:
        quarantine.reasons["pairs"].update(meta["reasons"])
    counts = {"products": preparing.record_counts("products", product_counts["read"], quarantine),
              "pairs": preparing.record_counts("pairs", sum(m["read"] for m in metas), quarantine)}
    quarantine_path = out / "quarantine.jsonl"
    write_quarantine(quarantine_path, shards, plan_doc, metas)
    report = {k: v for k, v in plan_doc["report"].items() if k != "product_counts"}
    report.update(data_config=to_dict(cfg), counts=counts, quarantine_file=str(quarantine_path), max_bad_fraction=cfg.max_bad_fraction)
    for kind, c in counts.items():
        log.info("%s: read %d, good %d, quarantined %d %s", kind, c["read"], c["good"], c["quarantined"], c["reasons"])
    inputs = {kind: [i["path"] for i in files] for kind, files in report["inputs"].items()}
    try:
        preparing.check_threshold(counts, cfg.max_bad_fraction, quarantine_path, inputs)
        if not sum(m["rows"]["train"] for m in metas):
            raise BadInputError("every query fell into the holdout; provide more distinct queries")
    except StepError as exc:
        atomic_write_json(done, {**report, "error": str(exc)})
        raise

    # ---- the final schema, catalog and pairs
    plan_schema = feature_schema.Schema.load(shards / "schema.json")
    schema = final_schema(plan_schema, {label for m in metas for label in m["labels"]}, plan_doc["schema_fixed"])
    products = prepared_data.read_products(shards / "products.parquet", cfg, plan_schema)
    products.class_id = _remap_classes(products.class_id, plan_schema, schema)
    preparing.write_outputs(out, (shards / "tokenizer.json").read_bytes(), schema, products)
    stats = assemble_pairs(out, shards, metas, schema, cfg, products)
    if not stats.num["holdout"]:
        log.warning("the holdout is empty (too few distinct queries); validation will have nothing to score")
    report.update(preparing.summary(cfg, schema, products, stats))
    report.update(status="ok", outputs={name: sha256_file(out / name) for name in preparing.OUTPUT_NAMES},
                  shards={"plan_id": plan_doc["plan_id"], "units": len(metas), "shard_count": shard_count},
                  elapsed_s=round(time.time() - started, 3))
    atomic_write_json(done, report)
    shutil.rmtree(shards / "units")  # the bulk, copied into the outputs; plan.json says the finish is done
    log.info("prepared %d products, %d train / %d holdout pairs from %d units in %s", len(products),
             stats.num["train"], stats.num["holdout"], len(metas), out)
    return report


def run_phase(args: argparse.Namespace, preset) -> dict[str, Any]:
    """`prepare --phase plan|shard|finish`."""
    if args.phase == "plan":
        return plan(args, preset)
    if args.phase == "shard":
        return run_shard(args.run_dir, args.shard_index, args.shard_count)
    return finish(args.run_dir, args.shard_count, args.max_bad_fraction)
