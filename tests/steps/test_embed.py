"""embed: sharded catalog inference -> Parquet + manifest; idempotent, resumable, array-job defaults."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_steps import inference, shards
from pipeline_steps.__main__ import main as cli
from pipeline_steps.errors import BadConfigError
from pipeline_steps.fileio import read_json
from pipeline_steps.prepared_data import load_prepared
from tests.steps.conftest import REPO, cli_env
from tests.steps.fixtures_trained import checkpoint_at, tiny_trained, trained_run  # noqa: F401  fixtures

EMBEDDING_DIM = 32  # tiny preset


def _embed(run_dir: Path, *extra: object) -> int:
    return cli(["embed", "--run-dir", str(run_dir), "--backend", "cpu", *map(str, extra)])


def _read_all(run_dir: Path) -> tuple[list[str], np.ndarray]:
    manifest = read_json(run_dir / "embeddings" / "manifest.json")
    ids, vectors = [], []
    for shard in manifest["shards"]:
        table = pq.read_table(run_dir / "embeddings" / shard["file"])
        ids += table.column("id").to_pylist()
        vectors.append(np.asarray(table.column("embedding").combine_chunks().flatten()).reshape(len(table), -1))
    return ids, np.concatenate(vectors)


def _mtimes(run_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (run_dir / "embeddings").glob("part-*.parquet")}


def test_all_shards_give_a_manifest_with_every_product_once(trained_run: Path):
    catalog = load_prepared(trained_run).products.ids
    for index in range(4):
        assert not (trained_run / "embeddings" / "manifest.json").exists()  # published by the last shard only
        assert _embed(trained_run, "--shard-index", index, "--shard-count", 4) == 0

    manifest = read_json(trained_run / "embeddings" / "manifest.json")
    assert manifest["shard_count"] == 4 and manifest["total_count"] == len(catalog)
    assert manifest["embedding_dim"] == EMBEDDING_DIM
    assert manifest["checkpoint_sha256"] == inference.resolve_checkpoint(trained_run)[1]
    assert [s["rows"] for s in manifest["shards"]] == [60, 60, 60, 60]
    assert manifest["shards"][0]["first_id"] == catalog[0] and manifest["shards"][-1]["last_id"] == catalog[-1]

    ids, vectors = _read_all(trained_run)
    assert ids == list(catalog)  # every product exactly once, in catalog order
    schema = pq.read_schema(trained_run / "embeddings" / "part-00000-of-00004.parquet")
    column_type = schema.field("embedding").type
    assert pa.types.is_fixed_size_list(column_type) and column_type.list_size == EMBEDDING_DIM
    assert column_type.value_type == pa.float32() and schema.field("id").type == pa.string()
    assert vectors.dtype == np.float32 and vectors.shape == (len(catalog), EMBEDDING_DIM)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)

    # Sharding does not change the numbers: one shard of everything gives the same embeddings.
    assert _embed(trained_run, "--shard-count", 1, "--out", trained_run / "single") == 0
    single = pq.read_table(trained_run / "single" / "part-00000-of-00001.parquet")
    single_vectors = np.asarray(single.column("embedding").combine_chunks().flatten()).reshape(len(single), -1)
    np.testing.assert_allclose(single_vectors, vectors, atol=1e-5)


def test_resume_redoes_broken_shards_and_skips_complete_ones(trained_run: Path, caplog):
    for index in range(4):
        assert _embed(trained_run, "--shard-index", index, "--shard-count", 4) == 0
    out = trained_run / "embeddings"
    expected_ids, expected = _read_all(trained_run)
    before = _mtimes(trained_run)

    # Shard 1: a truncated part (the sidecar's checksum no longer matches).
    part1 = out / "part-00001-of-00004.parquet"
    part1.write_bytes(part1.read_bytes()[:100])
    # Shard 2: the writer died mid-write: only fileio's temp file exists, no part, no sidecar.
    (out / "part-00002-of-00004.parquet").unlink()
    (out / "_shards" / "part-00002-of-00004.json").unlink()
    stale_tmp = out / ".part-00002-of-00004.parquet.abc123.tmp"
    stale_tmp.write_bytes(b"PAR1 half written")
    (out / "manifest.json").unlink()

    caplog.set_level(logging.INFO, logger="pipeline_steps.embed")
    for index in range(4):
        assert _embed(trained_run, "--shard-index", index, "--shard-count", 4) == 0

    after = _mtimes(trained_run)
    assert after["part-00000-of-00004.parquet"] == before["part-00000-of-00004.parquet"]
    assert after["part-00003-of-00004.parquet"] == before["part-00003-of-00004.parquet"]
    assert after["part-00001-of-00004.parquet"] != before["part-00001-of-00004.parquet"]
    assert not stale_tmp.exists()
    log = caplog.text
    assert "shard 0/4 already complete" in log and "shard 3/4 already complete" in log
    assert "checksum mismatch" in log and "not written yet" in log

    ids, vectors = _read_all(trained_run)
    assert ids == expected_ids
    np.testing.assert_allclose(vectors, expected, atol=1e-6)


def test_sigkilled_shard_is_redone(trained_run: Path):
    """Kill a real embed process (as soon as its temp file appears, or wherever it is), rerun."""
    out = trained_run / "embeddings"
    command = [sys.executable, "-m", "pipeline_steps", "embed", "--run-dir", str(trained_run), "--backend", "cpu",
               "--shard-index", "0", "--shard-count", "2", "--batch-size", "4"]
    proc = subprocess.Popen(command, env=cli_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if out.is_dir() and any(out.glob(".part-*.tmp")):
            break
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    assert _embed(trained_run, "--shard-index", 0, "--shard-count", 2) == 0
    assert _embed(trained_run, "--shard-index", 1, "--shard-count", 2) == 0
    assert not list(out.glob(".*.tmp"))
    ids, vectors = _read_all(trained_run)
    assert ids == load_prepared(trained_run).products.ids
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_another_checkpoint_redoes_shards(trained_run: Path, caplog):
    assert _embed(trained_run, "--checkpoint", checkpoint_at(trained_run, 2)) == 0
    first = read_json(trained_run / "embeddings" / "manifest.json")
    caplog.set_level(logging.INFO, logger="pipeline_steps.embed")
    assert _embed(trained_run, "--checkpoint", checkpoint_at(trained_run, 4)) == 0
    second = read_json(trained_run / "embeddings" / "manifest.json")
    assert "made by another checkpoint" in caplog.text
    assert first["checkpoint_sha256"] != second["checkpoint_sha256"]
    assert second["checkpoint"].endswith("step-000000004.pt")


def test_shard_defaults_come_from_the_array_job(trained_run: Path, monkeypatch):
    assert shards.resolve_shard(None, None, {}) == (0, 1)
    array_env = {"AWS_BATCH_JOB_ARRAY_INDEX": "2", "AWS_BATCH_JOB_ARRAY_SIZE": "3"}
    assert shards.resolve_shard(None, None, array_env) == (2, 3)
    assert shards.resolve_shard(1, 2, array_env) == (1, 2)  # flags win
    with pytest.raises(BadConfigError, match="AWS_BATCH_JOB_ARRAY_SIZE"):
        shards.resolve_shard(None, None, {"AWS_BATCH_JOB_ARRAY_INDEX": "2"})
    with pytest.raises(BadConfigError, match="shard index < shard count"):
        shards.resolve_shard(3, 3, {})
    assert [shards.shard_bounds(10, i, 3) for i in range(3)] == [(0, 3), (3, 6), (6, 10)]

    monkeypatch.setenv("AWS_BATCH_JOB_ARRAY_INDEX", "1")
    monkeypatch.setenv("AWS_BATCH_JOB_ARRAY_SIZE", "3")
    assert _embed(trained_run) == 0
    sidecar = read_json(trained_run / "embeddings" / "_shards" / "part-00001-of-00003.json")
    assert (sidecar["row_start"], sidecar["row_end"], sidecar["rows"]) == (80, 160, 80)
    assert not (trained_run / "embeddings" / "manifest.json").exists()  # shards 0 and 2 still missing

    monkeypatch.delenv("AWS_BATCH_JOB_ARRAY_SIZE")
    assert _embed(trained_run) == 78  # index without a size: a config error, not a guess


def test_merge_manifest_only(trained_run: Path, capsys):
    for index in range(3):
        if index != 1:
            assert _embed(trained_run, "--shard-index", index, "--shard-count", 3) == 0
    # Strict merge names the missing shard and exits with the bad-input code.
    assert _embed(trained_run, "--merge-manifest-only") == 65
    assert _embed(trained_run, "--shard-index", 1, "--shard-count", 3) == 0
    (trained_run / "embeddings" / "manifest.json").unlink()
    assert _embed(trained_run, "--merge-manifest-only") == 0
    manifest = read_json(trained_run / "embeddings" / "manifest.json")
    assert manifest["shard_count"] == 3 and manifest["total_count"] == 240
