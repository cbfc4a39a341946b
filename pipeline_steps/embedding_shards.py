"""The embed step's output: Parquet shards part-<i>-of-<n>.parquet with a JSON sidecar each (written
atomically, sidecar last), whether a shard is complete for a checkpoint, and the manifest the step
that finds every shard done writes. Files and resume rules: docs/training.md, "Validation, the
quality gate, embeddings"."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from pipeline_contract import EMBEDDINGS_MANIFEST

from .errors import BadInputError, RetryableError
from .fileio import atomic_path, atomic_write_json, read_json, sha256_file
from .shards import shard_bounds

log = logging.getLogger("pipeline_steps.embed")

MANIFEST_FORMAT_VERSION = 1
_PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})\.json$")



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
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"), **(extra or {}),
    }
    atomic_write_json(sidecar, meta)
    return meta



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
    missing = [i for i in range(shard_count) if not sidecar_path(out_dir, i, shard_count).exists()]
    if missing and not strict:
        log.info("manifest: waiting for %d of %d shards (e.g. %s)", len(missing), shard_count, missing[:5])
        return None
    try:
        if missing:
            raise BadInputError(
                f"{len(missing)} of {shard_count} shards are missing (indices {missing[:20]}); rerun "
                f"`embed --shard-index I --shard-count {shard_count}` for them (or the array job)")
        metas = _consistent_sidecars(out_dir, shard_count, checkpoint_sha256)
        seen = _verified_ids(out_dir, metas, shard_count)
        _check_coverage(seen, catalog_ids)
    except BadInputError as exc:
        if strict:
            raise
        log.info("manifest not written yet: %s", exc)
        return None
    manifest = _manifest(metas, shard_count, len(seen))
    atomic_write_json(out_dir / EMBEDDINGS_MANIFEST, manifest)
    log.info("manifest: %d shards, %d embeddings of dim %d -> %s", shard_count, manifest["total_count"],
             manifest["embedding_dim"], out_dir / EMBEDDINGS_MANIFEST)
    return manifest


def _consistent_sidecars(out_dir: Path, shard_count: int, checkpoint_sha256: str | None) -> list[dict[str, Any]]:
    """Every shard's sidecar, made by one checkpoint (`checkpoint_sha256` when given) at one dimension."""
    metas = [read_json(sidecar_path(out_dir, i, shard_count)) for i in range(shard_count)]
    shas = {m["checkpoint_sha256"] for m in metas}
    if checkpoint_sha256 is not None:
        shas.add(checkpoint_sha256)
    if len(shas) > 1:
        stale = [m["shard_index"] for m in metas if checkpoint_sha256 and m["checkpoint_sha256"] != checkpoint_sha256]
        raise BadInputError(
            f"shards were made by different checkpoints ({len(shas)} distinct sha256; stale shards "
            f"{stale[:20] or 'unknown'}); rerun embed for all shards with one --checkpoint")
    dims = {m["embedding_dim"] for m in metas}
    if len(dims) != 1:
        raise BadInputError(f"shards disagree on embedding_dim {sorted(dims)}; rerun all shards")
    return metas


def _verified_ids(out_dir: Path, metas: list[dict[str, Any]], shard_count: int) -> list[str]:
    """The ids of every part in shard order, each part checked against its sidecar."""
    import pyarrow.parquet as pq

    seen: list[str] = []
    for meta in metas:
        part = out_dir / meta["file"]
        try:
            digest = sha256_file(part)
            ids = pq.read_table(part, columns=["id"]).column("id").to_pylist()
        except FileNotFoundError:
            raise BadInputError(f"{part} is listed by its sidecar but missing; "
                                f"rerun shard {meta['shard_index']}") from None
        except OSError as exc:  # an FSx/S3 hiccup while reading a file that exists
            raise RetryableError(f"could not read {part}: {exc}") from exc
        if digest != meta["sha256"] or len(ids) != meta["rows"]:
            raise BadInputError(f"{part} does not match its sidecar (sha256 or row count); rerun "
                                f"`embed --shard-index {meta['shard_index']} --shard-count {shard_count}`")
        seen.extend(ids)
    return seen


def _check_coverage(seen: list[str], catalog_ids: Sequence[str]) -> None:
    if seen == list(catalog_ids):
        return
    seen_set, catalog_set = set(seen), set(catalog_ids)
    duplicates = len(seen) - len(seen_set)
    absent = sorted(catalog_set - seen_set)[:5]
    unknown = sorted(seen_set - catalog_set)[:5]
    raise BadInputError(
        f"the shards do not cover the catalog exactly once ({len(seen)} rows for {len(catalog_ids)} "
        f"products; {duplicates} duplicates; missing e.g. {absent}; not in catalog e.g. {unknown}): the "
        "catalog changed after some shards were written -- rerun every shard")


def _manifest(metas: list[dict[str, Any]], shard_count: int, total: int) -> dict[str, Any]:
    first = metas[0]
    return {
        "format_version": MANIFEST_FORMAT_VERSION,
        "shard_count": shard_count,
        "total_count": total,
        "embedding_dim": first["embedding_dim"],
        "embedding_dtype": "float32",
        "normalized": True,
        "checkpoint": first["checkpoint"],
        "checkpoint_sha256": first["checkpoint_sha256"],
        "columns": {"id": "string", "embedding": f"fixed_size_list<float32, {first['embedding_dim']}>"},
        "shards": [{k: m[k] for k in ("shard_index", "file", "rows", "bytes", "sha256", "first_id", "last_id")}
                   for m in metas],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
