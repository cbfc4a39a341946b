"""The preparing library both phases of `prepare` use (pipeline_steps/steps/prepare.py runs them):
reading and validating the inputs with a quarantine, the tokenizer and feature schema (trained, or
an --init-from run's), the catalog's static-shape arrays, the pairs spilled and tokenised in
chunks, the outputs and prepare.json. `prepare()` runs it all in one process; the array-job
phases (prepare_shards.py) spread the pairs over the children and write the same outputs. Files
and formats: docs/data.md, "Outputs"; memory: the catalog plus one chunk of pairs ("Scale")."""

from __future__ import annotations

import argparse
import collections.abc
import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from pipeline_contract import FSX_INCOMING, PREPARE_REPORT, PREPARED_DIR

from . import (
    batch_validation,
    feature_schema,
    prepared_data,
    record_reading,
    record_validation,
    static_batches,
    tokenization,
    upload_readiness,
    worker_pool,
)
from .config import DataConfig, to_dict
from .errors import BadConfigError, BadInputError, StepError
from .fileio import atomic_path, atomic_write_bytes, atomic_write_json, sha256_file
from .pretrained import previous_staged
from .pretrained import stage as stage_pretrained

log = logging.getLogger("pipeline_steps.prepare")

RAW_RECORD_CHARS = 1000
"""A quarantined record is kept up to this many characters: enough to see the problem, bounded
when a 'record' is a 50 MB line."""
PAIR_CHUNK = 65_536
"""Valid pairs held in memory at once (and the rows of one Parquet row group at most): prepare's
memory is the catalog plus one chunk, whatever the number of pairs."""
TOKENIZER_SAMPLE = 100_000
"""Distinct texts the tokenizer is trained on at most (half products, half training queries),
chosen by hash: the same sample whatever the input order or sharding."""
TOKENIZER_SAMPLE_CHARS = 1 << 24
"""Characters of each half of the tokenizer's sample at most (the texts with the smallest hashes
that fit): training time and memory grow with the characters, and 50,000 long descriptions would
be 100+ million of them (docs/data.md, "Scale")."""
TEXT_CHUNK = 8192
"""Rows per chunk of the catalog's text column: a multiple of Parquet's write batch (1,024 rows),
so products.parquet is the same file as written from one contiguous column."""
WORK_DIR = "_work"
"""RUN_DIR/prepared/_work/: validated pairs between the validation and the tokenisation pass."""


# ---------------------------------------------------------------------------------------------
# Quarantine
# ---------------------------------------------------------------------------------------------

class Quarantine:
    """Bad records with their reasons, counted per kind and streamed to a JSON Lines file as they
    are found (kept in `entries` instead when there is no file)."""

    def __init__(self, sink: IO[bytes] | None = None):
        self._sink = sink
        self.entries: list[dict[str, Any]] = []
        self.reasons: dict[str, Counter] = {"products": Counter(), "pairs": Counter()}

    def add(self, kind: str, source: str, line: int, reason: str, detail: str, raw: str) -> None:
        self.reasons[kind][reason] += 1
        entry = {"kind": kind, "source": source, "line": line, "reason": reason, "detail": detail,
                 "record": raw[:RAW_RECORD_CHARS]}
        if self._sink is None:
            self.entries.append(entry)
        else:
            self._sink.write(json.dumps(entry, sort_keys=True).encode("ascii") + b"\n")  # escapes non-ASCII

    def count(self, kind: str) -> int:
        return sum(self.reasons[kind].values())

    def extend(self, kind: str, reasons: Counter, path: Path) -> None:
        """Add the entries another Quarantine streamed to `path` (a worker's), and their counts."""
        self.reasons[kind].update(reasons)
        with open(path, "rb") as part:
            if self._sink is None:
                self.entries += [json.loads(line) for line in part]
            else:
                shutil.copyfileobj(part, self._sink)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _data_dir_inputs(data_dir: Path) -> tuple[list[Path], list[Path]]:
    if not data_dir.exists():
        raise BadInputError(f"--data {data_dir} does not exist; check the path (on AWS: "
                            f"{FSX_INCOMING}/<dataset>/<version>)")
    if not data_dir.is_dir():
        raise BadInputError("--data expects a directory holding products/ and pairs/; for single files "
                            "use --products FILE --pairs FILE")
    entries = sorted(p for p in data_dir.iterdir() if not p.name.startswith((".", "_")))
    found = {}
    for kind in ("products", "pairs"):
        paths = [p for p in entries if p.name.startswith(kind)]
        if not paths:
            raise BadInputError(f"{data_dir} has no {kind} input; expected {data_dir}/{kind}/part-*.jsonl|parquet "
                                f"(or a {kind}*.jsonl / {kind}*.parquet file)")
        found[kind] = [f for p in paths for f in record_reading.list_input_files(p)]
    return found["products"], found["pairs"]


def resolve_inputs(args: argparse.Namespace, run_dir: Path, seed: int) -> tuple[list[Path], list[Path]]:
    if args.demo:
        from .demo_data import write_demo

        out = write_demo(run_dir / "input", args.preset, seed)
        log.info("wrote the %s demo data to %s", args.preset, out)
        return _data_dir_inputs(out)
    if args.data is not None:
        upload_readiness.wait_for_upload(args.data, args.upload_timeout)
        return _data_dir_inputs(args.data)
    return record_reading.list_input_files(args.products), record_reading.list_input_files(args.pairs)


def input_checksums(files: Sequence[Path]) -> list[dict[str, Any]]:
    return [{"path": str(f), "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files]


GC_THRESHOLDS = (100_000, 50, 50)
"""Python's cyclic garbage collector thresholds while records are read: its default (700, 10, 10)
walks the growing catalog of record objects over and over, a third of the time it takes to read
the catalog; the records form no reference cycles, and each is freed by its reference count."""


@contextlib.contextmanager
def fewer_gc_passes() -> Iterator[None]:
    """Run the block with GC_THRESHOLDS (https://docs.python.org/3/library/gc.html#gc.set_threshold)."""
    before = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _quarantine_batch(kind: str, batch: record_reading.RecordBatch, rejected: list[batch_validation.Rejected], quarantine: Quarantine) -> None:
    """Add the rejected records of `batch` to the quarantine, in input order."""
    for r in sorted(rejected, key=lambda r: r.index):
        quarantine.add(kind, batch.source, batch.lines[r.index], r.reason, r.detail,
                       batch.raw_record(r.index).raw_text())


@dataclass
class Catalog(collections.abc.Sequence):
    """The valid products (the first of each id), in input order: the records, without their
    descriptions, and `texts`, each product's title and description as the encoder reads them, in
    one Arrow column (a catalog's descriptions are most of its bytes: held once, compactly). So a
    record's `text` is its title only: read `texts`."""

    records: list[record_validation.ProductRecord]
    texts: pa.ChunkedArray

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]

    def text_chunks(self) -> Iterator[list[str]]:
        """The texts as lists of at most TEXT_CHUNK strings."""
        return (chunk.to_pylist() for chunk in self.texts.chunks)


def read_products(files: Sequence[Path], cfg: DataConfig, quarantine: Quarantine) -> tuple[Catalog, int]:
    """Valid products (first of each id) and the number of records read."""
    products: list[record_validation.ProductRecord] = []
    chunks: list[pa.Array] = []
    texts: list[str] = []
    first_seen: dict[str, str] = {}
    num_read = 0
    for batch in record_reading.iter_batches(files):
        num_read += len(batch)
        valid, rejected = batch_validation.validate_products(batch, cfg.max_text_chars)
        for i, product in valid:
            if product.id in first_seen:
                rejected.append(batch_validation.Rejected(i, "duplicate product id",
                                           f"id {product.id!r} already defined at {first_seen[product.id]}"))
                continue
            first_seen[product.id] = f"{batch.source}:{batch.lines[i]}"
            texts.append(product.text)
            product.description = None  # held in `texts` (Catalog)
            products.append(product)
        _quarantine_batch("products", batch, rejected, quarantine)
        while len(texts) >= TEXT_CHUNK:
            chunks.append(pa.array(texts[:TEXT_CHUNK], pa.string()))
            del texts[:TEXT_CHUNK]
    chunks.append(pa.array(texts, pa.string()))
    return Catalog(products, pa.chunked_array(chunks, pa.string())), num_read


@dataclass
class PairChunk:
    """Up to PAIR_CHUNK validated pairs, as columns."""

    queries: list[str]
    product_index: np.ndarray  # int64 [n], row in the catalog
    weight: np.ndarray  # float32 [n]
    labels: list[str | None]

    def __len__(self) -> int:
        return len(self.queries)


def iter_pair_chunks(files: Sequence[Path], cfg: DataConfig, product_row: dict[str, int], quarantine: Quarantine,
                     num_read: Counter, chunk_size: int = PAIR_CHUNK,
                     batches: Iterable[record_reading.RecordBatch] | None = None) -> Iterator[PairChunk]:
    """The valid pairs whose product exists, PAIR_CHUNK at a time; num_read["pairs"] counts every record
    read (of `files`, or the given `batches`: one unit of them)."""
    queries: list[str] = []
    rows: list[int] = []
    weights: list[float] = []
    labels: list[str | None] = []
    for batch in record_reading.iter_batches(files) if batches is None else batches:
        num_read["pairs"] += len(batch)
        valid, rejected = batch_validation.validate_pairs(batch, cfg.max_text_chars)
        found = [product_row.get(product_id) for product_id in valid.product_ids]
        known = [k for k, row in enumerate(found) if row is not None]
        for k in (k for k, row in enumerate(found) if row is None):
            rejected.append(batch_validation.Rejected(valid.index[k], "unknown product_id", f"product {valid.product_ids[k]!r} "
                                       f"is not in the catalog (or was quarantined)"))
        if len(known) < len(found):
            found, valid = [found[k] for k in known], valid.subset(known)
        queries += valid.queries
        rows += found
        weights += valid.weights
        labels += valid.labels
        _quarantine_batch("pairs", batch, rejected, quarantine)
        while len(queries) >= chunk_size:
            yield PairChunk(queries[:chunk_size], np.array(rows[:chunk_size], np.int64),
                            np.array(weights[:chunk_size], np.float32), labels[:chunk_size])
            del queries[:chunk_size], rows[:chunk_size], weights[:chunk_size], labels[:chunk_size]
    if queries:
        yield PairChunk(queries, np.array(rows, np.int64), np.array(weights, np.float32), labels)


def record_counts(kind: str, num_read: int, quarantine: Quarantine) -> dict[str, Any]:
    bad = quarantine.count(kind)
    return {"read": num_read, "good": num_read - bad, "quarantined": bad,
            "fraction_bad": bad / num_read if num_read else 0.0,
            "reasons": dict(sorted(quarantine.reasons[kind].items()))}


def _names(files: Sequence[Path], limit: int = 5) -> str:
    shown = ", ".join(str(f) for f in files[:limit])
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")


def check_threshold(counts: dict[str, dict[str, Any]], max_bad_fraction: float, quarantine_path: Path,
                    files: dict[str, Sequence[Path]]) -> None:
    for kind, c in counts.items():
        if c["read"] == 0:
            raise BadInputError(f"the {kind} input holds no records: {_names(files[kind])} "
                                f"(only blank lines or empty files); upload non-empty {kind} shards")
        if c["fraction_bad"] > max_bad_fraction:
            reasons = ", ".join(f"{r}: {n}" for r, n in c["reasons"].items())
            raise BadInputError(
                f"{c['quarantined']} of {c['read']} {kind} records are bad ({c['fraction_bad']:.2%} > "
                f"max_bad_fraction {max_bad_fraction:.2%}; {reasons}); see {quarantine_path} for each record, "
                f"its source line and reason; fix the input, or raise the threshold with --max-bad-fraction")
        if c["good"] == 0:
            raise BadInputError(f"no valid {kind} records; see {quarantine_path}")


# ---------------------------------------------------------------------------------------------
# --init-from: the previous tokenizer and schema
# ---------------------------------------------------------------------------------------------

def load_previous(init_from: Path) -> tuple[bytes, feature_schema.Schema, str]:
    """(tokenizer.json bytes, schema, where they came from) of the run or checkpoint to continue
    from: RUN_DIR/prepared/ when it exists, else the checkpoint (the given .pt, or the run's latest)."""
    if not init_from.exists():
        raise BadInputError(f"--init-from {init_from} does not exist; pass the previous run dir or a checkpoint .pt")
    prepared = init_from / PREPARED_DIR
    if init_from.is_dir() and (prepared / "tokenizer.json").is_file() and (prepared / "schema.json").is_file():
        return (prepared / "tokenizer.json").read_bytes(), feature_schema.Schema.load(prepared / "schema.json"), str(prepared)
    from . import checkpoint  # imports torch and the model: paid only on this path

    if init_from.is_dir() and checkpoint.latest(init_from) is None:
        raise BadInputError(f"--init-from {init_from} has neither {PREPARED_DIR}/tokenizer.json + schema.json nor a "
                            f"valid checkpoint; pass the previous run dir or one of its checkpoints (.pt)")
    source = checkpoint.resolve(init_from)
    state = checkpoint.load(source)  # verifies the manifest checksum
    try:
        tok_json, tok_sha, schema = state["tokenizer"]["json"], state["tokenizer"].get("sha256"), state["schema"]
    except (KeyError, TypeError):
        raise BadInputError(f"checkpoint {source} stores no tokenizer/schema; pass the run dir that "
                            f"produced it to --init-from instead") from None
    data = tok_json.encode("utf-8")
    if tok_sha and hashlib.sha256(data).hexdigest() != tok_sha:
        raise BadInputError(f"the tokenizer stored in {source} fails its sha256 check; the checkpoint is "
                            f"damaged: pass another checkpoint or the previous run dir")
    return data, feature_schema.Schema.from_dict(dict(schema)), str(source)


# ---------------------------------------------------------------------------------------------
# Building the outputs
# ---------------------------------------------------------------------------------------------

def build_products(catalog: Catalog, tokenizer, schema: feature_schema.Schema, cfg: DataConfig) -> prepared_data.Products:
    records = catalog.records
    token_ids, lengths = tokenization.encode_texts(tokenizer, catalog.texts, max(cfg.length_buckets))
    return prepared_data.Products(ids=[p.id for p in records], titles=[p.title for p in records], texts=catalog.texts,
                      token_ids=token_ids, lengths=lengths, numeric=schema.numeric_matrix(records),
                      categorical=schema.categorical_matrix(records),
                      class_id=schema.class_ids([p.category for p in records]))


@dataclass
class SpilledPairs:
    """What the validation pass learned about the pairs: the valid ones sit in `files` (Arrow IPC,
    in input order, with their holdout side), the rest is small."""

    files: list[Path]
    num_read: int
    num_valid: int
    num_train: int
    query_sample: list[str]
    """Distinct training queries (at most TOKENIZER_SAMPLE // 2) the tokenizer learns from."""
    labels: set[str]


def tokenizer_sample() -> tokenization.TextSample:
    """One half of the tokenizer's training sample (products, or training queries)."""
    return tokenization.TextSample(TOKENIZER_SAMPLE // 2, TOKENIZER_SAMPLE_CHARS)


def _write_arrow(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


@functools.lru_cache(maxsize=1)
def _catalog_rows(path: str) -> dict[str, int]:
    """Product id -> row of the catalog ids `path` holds (read once per process)."""
    with pa.memory_map(path) as source:
        ids = pa.ipc.open_file(source).read_all().column("id").to_pylist()
    return {product_id: row for row, product_id in enumerate(ids)}


@dataclass(frozen=True)
class SpillJob:
    """One pair file to validate and split (in a worker): everything it needs is in here or in files."""

    index: int
    path: Path
    cfg: DataConfig
    catalog_ids: Path
    work: Path
    seed: int


@dataclass
class FileSpill:
    """One pair file validated: its spilled chunks, its quarantine part, and what the report needs."""

    files: list[Path]
    quarantine: Path
    reasons: Counter
    num_read: int
    num_valid: int
    num_train: int
    sample: tokenization.TextSample
    labels: set[str]


def _spill_file(job: SpillJob) -> FileSpill:
    """Validate one pair file and split its pairs by query, holding one chunk in memory at a time."""
    num_read: Counter = Counter()
    sample = tokenizer_sample()
    labels: set[str] = set()
    spilled, num_valid, num_train = [], 0, 0
    threshold = tokenization.holdout_threshold(job.cfg.holdout_fraction)
    known_keys: dict[str, int] = {}  # queries repeat across chunks
    part = job.work / f"quarantine-{job.index:06d}.jsonl"
    with open(part, "wb") as sink:
        quarantine = Quarantine(sink)
        for i, chunk in enumerate(iter_pair_chunks([job.path], job.cfg, _catalog_rows(str(job.catalog_ids)),
                                                   quarantine, num_read, PAIR_CHUNK)):
            keys = tokenization.query_keys(chunk.queries, job.seed, known_keys)
            holdout = keys < threshold
            num_valid += len(chunk)
            num_train += int((~holdout).sum())
            sample.update(q for q, h in zip(chunk.queries, holdout) if not h)  # holdout queries stay unseen
            labels.update(label for label in chunk.labels if label)
            spilled.append(job.work / f"pairs-{job.index:06d}-{i:06d}.arrow")
            _write_arrow(spilled[-1], pa.table({
                "query": pa.array(chunk.queries, pa.string()), "product_index": chunk.product_index,
                "weight": chunk.weight, "label": pa.array(chunk.labels, pa.string()), "holdout": holdout, "key": keys}))
    pa.default_memory_pool().release_unused()  # a worker's spilled chunks: its memory while the parent works on
    return FileSpill(spilled, part, quarantine.reasons["pairs"], num_read["pairs"], num_valid, num_train, sample, labels)


def spill_pairs(files: Sequence[Path], cfg: DataConfig, catalog_ids: Path, quarantine: Quarantine, work: Path,
                seed: int, pool: worker_pool.Pool = None) -> SpilledPairs:
    """Validate the pairs and split them by query: a file at a time, by the workers of `pool` when
    there is one; their quarantined records join `quarantine` in input order."""
    sample, labels, spilled, counts = tokenizer_sample(), set(), [], Counter()
    jobs = [SpillJob(i, Path(path), cfg, catalog_ids, work, seed) for i, path in enumerate(files)]
    for _, part in worker_pool.ordered_map(pool, _spill_file, jobs, window=len(jobs)):
        quarantine.extend("pairs", part.reasons, part.quarantine)
        sample.merge(part.sample)
        labels |= part.labels
        spilled += part.files
        counts.update(read=part.num_read, valid=part.num_valid, train=part.num_train)
    _catalog_rows.cache_clear()
    return SpilledPairs(spilled, counts["read"], counts["valid"], counts["train"], sample.texts(), labels)


@dataclass
class PairStats:
    """Running totals over the written pairs, for the report."""

    num: Counter = dataclasses.field(default_factory=Counter)
    keys: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=lambda: {"train": [], "holdout": []})
    at_max_length: int = 0
    train_per_bucket: Counter = dataclasses.field(default_factory=Counter)


PAIR_DTYPES = {"token_ids": np.int32, "lengths": np.int32, "product_index": np.int64, "weight": np.float32,
               "class_id": np.int64}


class PairOutputs:
    """The pair outputs while they are written: <side>_pairs.parquet (a row group per `append`) and
    the arrays training memory-maps (<side>_pairs.<name>.npy, `num_rows[side]` rows), each renamed
    into place when the block ends without an error; `stats` holds the report's running totals."""

    def __init__(self, out: Path, num_rows: dict[str, int], cfg: DataConfig, products: prepared_data.Products):
        self.out, self.num_rows, self.query_length = out, num_rows, cfg.query_length
        self.product_ids = pa.array(products.ids, pa.string())
        self.product_buckets = static_batches.bucket_index(products.lengths, cfg.length_buckets)
        self.stats = PairStats()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> PairOutputs:
        stack = self._stack.__enter__()
        # Each writer is entered after its atomic path, so it closes before the file is renamed.
        self.writers = {side: stack.enter_context(pq.ParquetWriter(stack.enter_context(atomic_path(
            self.out / f"{side}_pairs.parquet")), prepared_data.PAIRS_SCHEMA)) for side in self.num_rows}
        # Appended through files, not written into memory maps: a map's written pages count in the
        # process's RSS until it is closed (130+ MB at 1M pairs).
        self.arrays = {side: {name: stack.enter_context(open(stack.enter_context(atomic_path(
            prepared_data.pair_array_path(self.out, side, name))), "wb")) for name in prepared_data.PAIR_ARRAYS} for side in self.num_rows}
        for side, rows in self.num_rows.items():
            for name, fh in self.arrays[side].items():
                np.lib.format.write_array_header_1_0(fh, {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(PAIR_DTYPES[name])), "fortran_order": False,
                    "shape": (rows, self.query_length) if name == "token_ids" else (rows,)})
        return self

    def append(self, side: str, queries: pa.Array | pa.ChunkedArray, pairs: prepared_data.Pairs, keys: np.ndarray) -> None:
        """The next rows of `side`: the tokenised pairs, their query texts and query keys."""
        self.writers[side].write_table(prepared_data.pairs_table(queries, self.product_ids.take(pairs.product_index), pairs))
        for name, fh in self.arrays[side].items():
            fh.write(np.ascontiguousarray(getattr(pairs, name), dtype=PAIR_DTYPES[name]).data)
        self.stats.num[side] += len(pairs)
        self.stats.keys[side].append(keys)
        self.stats.at_max_length += int((pairs.lengths >= self.query_length).sum())
        if side == "train":
            self.stats.train_per_bucket.update(self.product_buckets[pairs.product_index].tolist())

    def __exit__(self, *exc) -> bool | None:
        return self._stack.__exit__(*exc)


PAIR_CHUNKS_AHEAD = 4
"""Chunks of pairs the workers tokenise ahead of the writer at most (about 12 MB each)."""


def _spilled_chunks(files: Sequence[Path], size: int) -> Iterator[pa.Table]:
    """The spilled pairs in input order, `size` rows at a time whatever file they were spilled to:
    the outputs get the same row groups whatever the number of input files or workers."""
    pending: list[pa.Table] = []
    rows = 0
    for path in files:
        with pa.memory_map(str(path)) as source:
            pending.append(pa.ipc.open_file(source).read_all())
        rows += pending[-1].num_rows
        while rows >= size:
            table = pa.concat_tables(pending)
            yield table.slice(0, size).combine_chunks()
            pending, rows = [table.slice(size)], rows - size
    if rows:
        yield pa.concat_tables(pending).combine_chunks()


@functools.lru_cache(maxsize=1)
def _text_encoder(tokenizer_path: str, max_length: int, workers: int) -> tokenization.TextEncoder:
    """The encoder of a process: the workers share the caches' memory of one process's."""
    return tokenization.TextEncoder(tokenization.load_tokenizer(tokenizer_path), max_length,
                                    tokenization.ENCODE_CACHE_TEXTS // workers, tokenization.WORD_CACHE_WORDS // workers)


def _encode_queries(tokenizer_path: str, max_length: int, workers: int, chunk: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids, lengths) of a chunk's queries (in a worker, whose encoder remembers texts across chunks)."""
    return _text_encoder(tokenizer_path, max_length, workers)(chunk.column("query"))


def write_pairs(spilled: SpilledPairs, tokenizer_path: Path, schema: feature_schema.Schema, cfg: DataConfig,
                products: prepared_data.Products, out: Path, pool: worker_pool.Pool = None) -> PairStats:
    """Tokenise the spilled pairs chunk by chunk (in worker processes when there are more CPUs than
    one) into the pair outputs (PairOutputs), in input order."""
    num_rows = {"train": spilled.num_train, "holdout": spilled.num_valid - spilled.num_train}
    workers = worker_pool.worker_count() if pool is not None else 1
    encode = functools.partial(_encode_queries, str(tokenizer_path), cfg.query_length, workers)
    with PairOutputs(out, num_rows, cfg, products) as outputs:
        for table, (token_ids, lengths) in worker_pool.ordered_map(pool, encode, _spilled_chunks(spilled.files, PAIR_CHUNK),
                                                                   window=PAIR_CHUNKS_AHEAD):
            holdout = table.column("holdout").to_numpy()
            for side, rows in (("train", np.flatnonzero(~holdout)), ("holdout", np.flatnonzero(holdout))):
                if len(rows):
                    part = table.take(rows)
                    product_index = part.column("product_index").to_numpy()
                    pairs = prepared_data.Pairs(
                        queries=[], token_ids=token_ids[rows], lengths=lengths[rows], product_index=product_index,
                        weight=part.column("weight").to_numpy(), class_id=pair_class_ids(
                            part.column("label").to_pylist(), product_index, schema, products.class_id))
                    outputs.append(side, part.column("query"), pairs, part.column("key").to_numpy())
    _text_encoder.cache_clear()
    return outputs.stats


def pair_class_ids(labels: Sequence[str | None], product_index: np.ndarray, schema: feature_schema.Schema,
                   product_class: np.ndarray) -> np.ndarray:
    """int64 [n]: a pair's own label wins; otherwise the class is its product's category."""
    has_label = np.array([label is not None for label in labels], dtype=bool)
    return np.where(has_label, schema.class_ids(labels), product_class[product_index]).astype(np.int64)


def schema_coverage(schema: feature_schema.Schema, products: Sequence[record_validation.ProductRecord], built: prepared_data.Products) -> dict[str, Any]:
    """How well a reused schema covers the new data: features it ignores, values it maps to 0."""
    seen_numeric = {k for p in products for k in p.numeric}
    seen_categorical = {k for p in products for k in p.categorical}
    unknown_values = {name: int(((built.categorical[:, j] == 0)
                                 & np.array([name in p.categorical for p in products], dtype=bool)).sum())
                      for j, name in enumerate(schema.categorical_names)}
    return {"ignored_numeric_features": sorted(seen_numeric - set(schema.numeric_names)),
            "ignored_categorical_features": sorted(seen_categorical - set(schema.categorical_names)),
            "unknown_categorical_values": unknown_values,
            "products_without_class": int((built.class_id == feature_schema.IGNORE_INDEX).sum())}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

def validate_inputs(product_files: Sequence[Path], pair_files: Sequence[Path], cfg: DataConfig, out: Path,
                    seed: int, report: dict[str, Any], pool: worker_pool.Pool = None) -> tuple[Catalog, SpilledPairs]:
    """Read and validate every record, stream the quarantine, spill the valid pairs to out/_work/,
    fill report["counts"], apply the threshold."""
    work = out / WORK_DIR
    shutil.rmtree(work, ignore_errors=True)  # a crashed attempt's chunks
    work.mkdir(parents=True)
    quarantine_path = out / "quarantine.jsonl"
    with atomic_path(quarantine_path) as tmp, open(tmp, "wb") as sink, fewer_gc_passes():
        quarantine = Quarantine(sink)
        catalog, num_products_read = read_products(product_files, cfg, quarantine)
        _write_arrow(work / "catalog-ids.arrow", pa.table({"id": pa.array([p.id for p in catalog], pa.string())}))
        spilled = spill_pairs(pair_files, cfg, work / "catalog-ids.arrow", quarantine, work, seed, pool)
    counts = {"products": record_counts("products", num_products_read, quarantine),
              "pairs": record_counts("pairs", spilled.num_read, quarantine)}
    report.update(counts=counts, quarantine_file=str(quarantine_path), max_bad_fraction=cfg.max_bad_fraction)
    for kind, c in counts.items():
        log.info("%s: read %d, good %d, quarantined %d %s", kind, c["read"], c["good"], c["quarantined"], c["reasons"])
    check_threshold(counts, cfg.max_bad_fraction, quarantine_path, {"products": product_files, "pairs": pair_files})
    if not spilled.num_train:
        raise BadInputError("every query fell into the holdout; provide more distinct queries")
    return catalog, spilled


def tokenizer_and_schema(init_from: Path | None, cfg: DataConfig, catalog: Catalog,
                         spilled: SpilledPairs, pretrained: Path | None = None, out: Path | None = None):
    """(tokenizer, its exact JSON bytes, schema, origin): reused unchanged from --init-from, taken from
    the --pretrained encoder, else learned from a bounded sample of the catalog and the training queries
    (holdout queries stay unseen)."""
    staged = stage_pretrained(pretrained, out, cfg.max_length, init_from) if out is not None else None
    if staged is not None:
        return (*staged[:2], feature_schema.Schema.fit(catalog, spilled.labels), staged[2])
    if init_from is not None:
        tokenizer_bytes, schema, origin = load_previous(init_from)
        tokenizer = Tokenizer.from_str(tokenizer_bytes.decode("utf-8"))
        log.info("reusing tokenizer and schema from %s", origin)
        # A model that started from BERT embeds BERT's vocabulary, not the preset's (train checks it).
        if tokenizer.get_vocab_size() > cfg.vocab_size and previous_staged(init_from) is None:
            raise BadConfigError(f"the reused tokenizer has {tokenizer.get_vocab_size()} tokens but this preset "
                                 f"embeds only {cfg.vocab_size}; use the previous run's --preset")
        return tokenizer, tokenizer_bytes, schema, origin
    product_sample = tokenizer_sample()
    for texts in catalog.text_chunks():
        product_sample.update(texts)
    tokenizer = tokenization.train_tokenizer(product_sample.texts() + spilled.query_sample, cfg.vocab_size)
    schema = feature_schema.Schema.fit(catalog, spilled.labels)
    return tokenizer, tokenizer.to_str(pretty=True).encode("utf-8"), schema, "trained"


def write_outputs(out: Path, tokenizer_bytes: bytes, schema: feature_schema.Schema, products: prepared_data.Products) -> None:
    """Write the tokenizer, schema and catalog (each atomically); the pairs are written by write_pairs."""
    atomic_write_bytes(out / "tokenizer.json", tokenizer_bytes)
    schema.save(out / "schema.json")
    prepared_data.save_products(out / "products.parquet", products)


OUTPUT_NAMES = ("tokenizer.json", "schema.json", "products.parquet", "train_pairs.parquet", "holdout_pairs.parquet",
                *(prepared_data.product_array_path(Path(), name).name for name in prepared_data.PRODUCT_ARRAYS),
                *(prepared_data.pair_array_path(Path(), side, name).name for side in ("train", "holdout") for name in prepared_data.PAIR_ARRAYS))


def _distinct_count(keys: np.ndarray) -> int:
    """The number of distinct values, by a sort: numpy 2's np.unique hashes uint64 keys, about
    100x slower than sorting them (0.9 s against 10 ms for a million)."""
    ordered = np.sort(keys)
    return int(len(ordered) and 1 + np.count_nonzero(ordered[1:] != ordered[:-1]))


def summary(cfg: DataConfig, schema: feature_schema.Schema, products: prepared_data.Products, stats: PairStats) -> dict:
    """The report's description of what was prepared."""
    distinct = {side: _distinct_count(np.concatenate(keys)) if keys else 0 for side, keys in stats.keys.items()}
    return {
        "schema": {"numeric": len(schema.numeric_names), "categorical": list(schema.cardinalities),
                   "classes": len(schema.class_names)},
        "split": {"train_pairs": stats.num["train"], "holdout_pairs": stats.num["holdout"],
                  "train_queries": distinct["train"], "holdout_queries": distinct["holdout"],
                  "holdout_fraction": cfg.holdout_fraction},
        # Texts at the cap were (most likely) truncated: a high share says the buckets are too short.
        "at_max_length": {"products": int((products.lengths >= max(cfg.length_buckets)).sum()),
                          "queries": stats.at_max_length},
        "train_pairs_per_bucket": {str(b): stats.train_per_bucket[i] for i, b in enumerate(cfg.length_buckets)},
    }


def data_config(args: argparse.Namespace, preset) -> DataConfig:
    """The preset's data config with the flags applied (BadConfigError for a bad value)."""
    cfg = preset.data
    if args.max_bad_fraction is not None:
        cfg = dataclasses.replace(cfg, max_bad_fraction=args.max_bad_fraction)  # validated (BadConfigError)
    if args.upload_timeout < 0:
        raise BadConfigError(f"--upload-timeout must be >= 0 seconds, got {args.upload_timeout}")
    return cfg


def prepare(args: argparse.Namespace, preset) -> dict[str, Any]:
    """The step without its tracking: validate, tokenise, write RUN_DIR/prepared/; returns prepare.json."""
    started = time.time()
    cfg = data_config(args, preset)
    out = args.run_dir / PREPARED_DIR
    out.mkdir(parents=True, exist_ok=True)
    (args.run_dir / PREPARE_REPORT).unlink(missing_ok=True)  # invalidate first: a crash below leaves no "ok" marker

    product_files, pair_files = resolve_inputs(args, args.run_dir, args.seed)
    inputs = {"products": input_checksums(product_files), "pairs": input_checksums(pair_files)}
    if args.data is not None:
        upload_readiness.check_checksums(args.data, {i["path"]: i["sha256"] for kind in inputs.values() for i in kind})
    report: dict[str, Any] = {
        "status": "failed", "preset": preset.name, "seed": args.seed, "data_config": to_dict(cfg), "inputs": inputs,
        "input_sha256": sha256_bytes(json.dumps(inputs, sort_keys=True).encode()),
        "init_from": str(args.init_from) if args.init_from else None,
    }
    with worker_pool.worker_pool(worker_pool.worker_count()) as pool:
        try:
            catalog, spilled = validate_inputs(product_files, pair_files, cfg, out, args.seed, report, pool)
            tokenizer, tokenizer_bytes, schema, origin = tokenizer_and_schema(
                args.init_from, cfg, catalog, spilled, args.pretrained, out)
            products = build_products(catalog, tokenizer, schema, cfg)
        except StepError as exc:
            # The report of a failed run says why, next to the quarantine that explains it.
            atomic_write_json(args.run_dir / PREPARE_REPORT, {**report, "error": str(exc)})
            raise
        write_outputs(out, tokenizer_bytes, schema, products)
        coverage = schema_coverage(schema, catalog, products)
        del catalog  # and below, the texts: most of a catalog's memory, which the pairs do not need
        products = dataclasses.replace(products, titles=[], texts=[])
        pa.default_memory_pool().release_unused()
        stats = write_pairs(spilled, out / "tokenizer.json", schema, cfg, products, out, pool)
    shutil.rmtree(out / WORK_DIR)
    if not stats.num["holdout"]:
        log.warning("the holdout is empty (too few distinct queries); validation will have nothing to score")
    report.update(summary(cfg, schema, products, stats))
    report.update(status="ok", outputs={name: sha256_file(out / name) for name in OUTPUT_NAMES},
                  tokenizer={"source": origin, "sha256": sha256_bytes(tokenizer_bytes),
                             "vocab_size": tokenizer.get_vocab_size()},
                  schema_coverage=coverage,
                  elapsed_s=round(time.time() - started, 3))
    atomic_write_json(args.run_dir / PREPARE_REPORT, report)
    log.info("prepared %d products, %d train / %d holdout pairs in %s (%.1fs)", len(products), stats.num["train"],
             stats.num["holdout"], out, report["elapsed_s"])
    return report
