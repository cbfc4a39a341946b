"""embed: batch inference of the catalog into Parquet shards plus a manifest.

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
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline_contract import EMBEDDINGS_DIR

from .. import distributed, tracking
from ..embedding_shards import build_manifest, detect_shard_count, part_name, shard_status, sidecar_path, write_shard
from ..inference import DEFAULT_BATCH_SIZE, check_compatible, embed_products, load_for_inference, resolve_checkpoint
from ..shards import remove_stale_temps, resolve_shard, shard_bounds

log = logging.getLogger("pipeline_steps.embed")


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
    from ..prepared_data import load_prepared

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
        remove_stale_temps(part)
        remove_stale_temps(sidecar)
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
