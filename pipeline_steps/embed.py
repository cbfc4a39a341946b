"""Step `embed`: batch inference of the catalog into Parquet shards plus a manifest.

Embeds shard i of n of DIR/prepared/'s catalog with a checkpoint (`--checkpoint`: a .pt file or a run
dir, default DIR) into OUT/part-<i>-of-<n>.parquet (OUT: --out, default DIR/embeddings); the process
that finds every shard done writes OUT/manifest.json. A complete shard is skipped on rerun. Files,
sharding and resume rules: docs/training.md, "Validation, the quality gate, embeddings".

Local:  python -m pipeline_steps embed --run-dir runs/demo [--shard-index 0 --shard-count 4 | --merge-manifest-only]
AWS:    array job "embed", one process per child (no torchrun: inference needs no collectives):
        python -m pipeline_steps embed --run-dir /fsx/runs/<run_id> --checkpoint CKPT --backend xla
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import distributed
from pipeline_contract import EMBEDDINGS_DIR, EMBEDDINGS_MANIFEST
from .errors import BadInputError, RetryableError
from . import tracking
from .fileio import atomic_path, atomic_write_json, read_json, sha256_file
from .inference import DEFAULT_BATCH_SIZE, check_compatible, embed_products, load_for_inference, resolve_checkpoint
from .shards import remove_stale_temps as _remove_stale_temps, resolve_shard, shard_bounds

log = logging.getLogger(__name__)

MANIFEST_FORMAT_VERSION = 1
_PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.json$")


# ============================================================================ shards

def part_name(shard_index: int, shard_count: int) -> str:
    return f"part-{shard_index:05d}-of-{shard_count:05d}.parquet"


def sidecar_path(out_dir: Path, shard_index: int, shard_count: int) -> Path:
    return out_dir / "_shards" / part_name(shard_index, shard_count).replace(".parquet", ".json")


def shard_status(out_dir: Path, shard_index: int, shard_count: int, *, checkpoint_sha256: str,
                 ids: Sequence[str]) -> str | None:
    """None when the shard is complete and current; else why it must be (re)done."""
    part = out_dir / part_name(shard_index, shard_count)
    sidecar = sidecar_path(out_dir, shard_index, shard_count)
    if not sidecar.exists():
        return "not written yet" if not part.exists() else "part without sidecar (writer interrupted)"
    try:
        meta = read_json(sidecar)
    except ValueError:
        return "sidecar unreadable"
    if not part.exists():
        return "part file missing"
    if meta.get("checkpoint_sha256") != checkpoint_sha256:
        return "made by another checkpoint"
    start, end = shard_bounds(len(ids), shard_index, shard_count)
    if meta.get("rows") != end - start or meta.get("first_id") != (ids[start] if end > start else None) \
            or meta.get("last_id") != (ids[end - 1] if end > start else None):
        return "catalog slice changed"
    if sha256_file(part) != meta.get("sha256"):
        return "checksum mismatch (truncated or modified part)"
    return None


def write_shard(out_dir: Path, shard_index: int, shard_count: int, ids: Sequence[str], embeddings: np.ndarray,
                *, checkpoint: Path, checkpoint_sha256: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the part atomically, then its sidecar (the completion mark); return the sidecar."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = out_dir / part_name(shard_index, shard_count)
    sidecar = sidecar_path(out_dir, shard_index, shard_count)
    dim = embeddings.shape[1]
    flat = pa.array(np.ascontiguousarray(embeddings, dtype=np.float32).reshape(-1), type=pa.float32())
    table = pa.table({"id": pa.array(list(ids), type=pa.string()),
                      "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})
    table = table.replace_schema_metadata({"checkpoint_sha256": checkpoint_sha256,
                                           "shard": f"{shard_index}/{shard_count}"})
    with atomic_path(part) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    meta = {
        "shard_index": shard_index, "shard_count": shard_count, "file": part.name,
        "rows": len(ids), "bytes": part.stat().st_size, "sha256": sha256_file(part),
        "embedding_dim": dim, "first_id": ids[0] if len(ids) else None, "last_id": ids[-1] if len(ids) else None,
        "checkpoint": str(checkpoint), "checkpoint_sha256": checkpoint_sha256,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **(extra or {}),
    }
    atomic_write_json(sidecar, meta)
    return meta


# ============================================================================ manifest

def detect_shard_count(out_dir: Path) -> int:
    counts = {int(m.group(2)) for p in (out_dir / "_shards").glob("part-*.json") if (m := _PART_RE.match(p.name))}
    if not counts:
        raise BadInputError(f"no shard sidecars under {out_dir / '_shards'}; run `embed` for every shard first")
    if len(counts) > 1:
        raise BadInputError(f"sidecars for several shard counts {sorted(counts)} under {out_dir / '_shards'}; "
                            "pass --shard-count N for the run to publish")
    return counts.pop()


def build_manifest(out_dir: Path, catalog_ids: Sequence[str], shard_count: int, *, strict: bool,
                   checkpoint_sha256: str | None = None) -> dict[str, Any] | None:
    """Check every shard and write OUT/manifest.json. With strict=False (after one shard) an
    incomplete or inconsistent set returns None with a log line: other children may still be
    (re)writing theirs. With strict=True (--merge-manifest-only) it raises naming what to rerun."""

    def fail(exc: Exception) -> None:
        if strict:
            raise exc
        log.info("manifest not written yet: %s", exc)

    sidecars = [sidecar_path(out_dir, i, shard_count) for i in range(shard_count)]
    missing = [i for i, p in enumerate(sidecars) if not p.exists()]
    if missing and not strict:
        log.info("manifest: waiting for %d of %d shards (e.g. %s)", len(missing), shard_count, missing[:5])
        return None
    if missing:
        return fail(BadInputError(
            f"{len(missing)} of {shard_count} shards are missing (indices {missing[:20]}); rerun "
            f"`embed --shard-index I --shard-count {shard_count}` for them (or the array job)"))
    metas = [read_json(p) for p in sidecars]
    shas = {m["checkpoint_sha256"] for m in metas}
    if checkpoint_sha256 is not None:
        shas.add(checkpoint_sha256)
    if len(shas) > 1:
        stale = [m["shard_index"] for m in metas if checkpoint_sha256 and m["checkpoint_sha256"] != checkpoint_sha256]
        return fail(BadInputError(
            f"shards were made by different checkpoints ({len(shas)} distinct sha256; stale shards "
            f"{stale[:20] or 'unknown'}); rerun embed for all shards with one --checkpoint"))
    dims = {m["embedding_dim"] for m in metas}
    if len(dims) != 1:
        return fail(BadInputError(f"shards disagree on embedding_dim {sorted(dims)}; rerun all shards"))

    import pyarrow.parquet as pq

    seen: list[str] = []
    for meta in metas:
        part = out_dir / meta["file"]
        try:
            digest = sha256_file(part)
            ids = pq.read_table(part, columns=["id"]).column("id").to_pylist()
        except FileNotFoundError:
            return fail(BadInputError(f"{part} is listed by its sidecar but missing; "
                                      f"rerun shard {meta['shard_index']}"))
        except OSError as exc:  # an FSx/S3 hiccup while reading a file that exists
            raise RetryableError(f"could not read {part}: {exc}") from exc
        if digest != meta["sha256"] or len(ids) != meta["rows"]:
            return fail(BadInputError(f"{part} does not match its sidecar (sha256 or row count); rerun "
                                      f"`embed --shard-index {meta['shard_index']} --shard-count {shard_count}`"))
        seen.extend(ids)
    if seen != list(catalog_ids):
        seen_set, catalog_set = set(seen), set(catalog_ids)
        duplicates = len(seen) - len(seen_set)
        absent = sorted(catalog_set - seen_set)[:5]
        unknown = sorted(seen_set - catalog_set)[:5]
        return fail(BadInputError(
            f"the shards do not cover the catalog exactly once ({len(seen)} rows for {len(catalog_ids)} "
            f"products; {duplicates} duplicates; missing e.g. {absent}; not in catalog e.g. {unknown}): the "
            "catalog changed after some shards were written -- rerun every shard"))

    first = metas[0]
    manifest = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "shard_count": shard_count,
        "total_count": len(seen),
        "embedding_dim": first["embedding_dim"],
        "embedding_dtype": "float32",
        "normalized": True,
        "checkpoint": first["checkpoint"],
        "checkpoint_sha256": first["checkpoint_sha256"],
        "columns": {"id": "string", "embedding": f"fixed_size_list<float32, {first['embedding_dim']}>"},
        "shards": [{k: m[k] for k in ("shard_index", "file", "rows", "bytes", "sha256", "first_id", "last_id")}
                   for m in metas],
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_json(out_dir / EMBEDDINGS_MANIFEST, manifest)
    log.info("manifest: %d shards, %d embeddings of dim %d -> %s", shard_count, manifest["total_count"],
             manifest["embedding_dim"], out_dir / EMBEDDINGS_MANIFEST)
    return manifest


# ============================================================================ CLI

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps embed", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", help="a .pt checkpoint or a run dir (its latest valid checkpoint); "
                                             "default: --run-dir")
    parser.add_argument("--backend", choices=distributed.BACKENDS, default=None,
                        help="default: xla on a Trainium host, cuda with a GPU, else cpu")
    parser.add_argument("--shard-index", type=int, default=None, help="default: $AWS_BATCH_JOB_ARRAY_INDEX or 0")
    parser.add_argument("--shard-count", type=int, default=None, help="default: $AWS_BATCH_JOB_ARRAY_SIZE or 1")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default: RUN_DIR/{EMBEDDINGS_DIR})")
    parser.add_argument("--merge-manifest-only", action="store_true",
                        help="only check every shard and (re)write manifest.json (after an array job)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Embed one shard (unless complete) and publish the manifest when every shard is there.
    Returns {"shard": sidecar or None, "skipped": bool, "manifest": manifest or None}."""
    from .data import load_prepared

    run_dir: Path = args.run_dir
    out_dir: Path = args.out or run_dir / EMBEDDINGS_DIR
    prepared = load_prepared(run_dir)
    catalog_ids = list(prepared.products.ids)

    if args.merge_manifest_only:
        count = args.shard_count or detect_shard_count(out_dir)
        sha = resolve_checkpoint(args.checkpoint)[1] if args.checkpoint else None
        return {"shard": None, "skipped": True,
                "manifest": build_manifest(out_dir, catalog_ids, count, strict=True, checkpoint_sha256=sha)}

    index, count = resolve_shard(args.shard_index, args.shard_count)
    ckpt_path, ckpt_sha = resolve_checkpoint(args.checkpoint or run_dir)
    part = out_dir / part_name(index, count)
    sidecar = sidecar_path(out_dir, index, count)
    start, end = shard_bounds(len(catalog_ids), index, count)

    reason = shard_status(out_dir, index, count, checkpoint_sha256=ckpt_sha, ids=catalog_ids)
    meta = None
    if reason is None:
        log.info("shard %d/%d already complete (%d rows, checkpoint %s...); skipping", index, count,
                 end - start, ckpt_sha[:12])
    else:
        log.info("shard %d/%d: embedding rows [%d, %d) (%s)", index, count, start, end, reason)
        _remove_stale_temps(part)
        _remove_stale_temps(sidecar)
        backend = args.backend or distributed.default_backend()
        extra: dict[str, Any] = {"row_start": start, "row_end": end, "backend": backend, "batch_size": args.batch_size}
        t0 = time.monotonic()
        inference = load_for_inference(ckpt_path, backend, sha256=ckpt_sha)
        check_compatible(inference, prepared)
        # Sorted by token length, fixed-size batches per length bucket (the last one padded with masked
        # rows): an XLA run compiles one graph per bucket, however large the catalog.
        embeddings = embed_products(inference, prepared.products, np.arange(start, end),
                                    batch_size=args.batch_size, buckets=prepared.data_cfg.length_buckets)
        graphs = distributed.compile_count(inference.world)
        if graphs is not None:
            extra["xla_graphs_compiled"] = graphs
        seconds = time.monotonic() - t0
        extra["seconds"] = round(seconds, 3)
        extra["rows_per_s"] = round((end - start) / seconds, 1) if seconds > 0 else None
        meta = write_shard(out_dir, index, count, catalog_ids[start:end], embeddings,
                           checkpoint=ckpt_path, checkpoint_sha256=ckpt_sha, extra=extra)
        log.info("shard %d/%d: %d embeddings in %.1fs -> %s", index, count, end - start, seconds, part)

    # Every child tries after its shard, so the last one to finish publishes the manifest.
    manifest = build_manifest(out_dir, catalog_ids, count, strict=False, checkpoint_sha256=ckpt_sha)
    return {"shard": meta, "skipped": reason is None, "manifest": manifest}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    # ---- tracking: this step as a child run of the pipeline's MLflow run (never fails the step)
    tracking.log_step("embed", args.run_dir, metrics=tracking.flatten(result.get("shard") or {}))
    return 0
