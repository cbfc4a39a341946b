"""`prepare` as an array job (plan, shards, finish): any shard count gives the single prepare's
records, quarantine and holdout; reruns are byte-identical; a killed child is redone, never used."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_steps import feature_schema, prepare_shards, prepared_data, preparing, record_reading, static_batches
from pipeline_steps.__main__ import main as cli
from pipeline_steps.demo_data import generate
from pipeline_steps.errors import ExitCode
from pipeline_steps.fileio import read_json
from tests.steps.test_prepare import BAD_PAIRS, BAD_PRODUCTS, _write_jsonl

UNIT_BYTES = 1500
"""Small units, so the tiny input is cut into many (JSON Lines lines straddle the cuts)."""
OUTPUTS = (*preparing.OUTPUT_NAMES, "quarantine.jsonl")


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    monkeypatch.setattr(prepare_shards, "UNIT_BYTES", UNIT_BYTES)


@pytest.fixture
def upload(tmp_path) -> Path:
    """Bad records among good ones, pairs in JSON Lines and in a Parquet file of several row
    groups, and pair labels that only some units hold (they add classes to the schema)."""
    products, pairs = generate(60, 3, seed=0)
    for i in range(0, len(pairs), 40):
        pairs[i]["label"] = f"label-{i % 3}"
    data = tmp_path / "upload"
    _write_jsonl(data / "products" / "part-00000.jsonl", products, BAD_PRODUCTS)
    _write_jsonl(data / "pairs" / "part-00000.jsonl", pairs[:120], BAD_PAIRS)
    pq.write_table(pa.Table.from_pylist(pairs[120:]), data / "pairs" / "part-00001.parquet", row_group_size=25)
    return data


def _sharded(run: Path, data: Path, count: int, *flags: str) -> int:
    """plan, every child, finish: what the state machine runs; the first non-zero exit code."""
    base = ["prepare", "--run-dir", str(run)]
    code = cli([*base, "--phase", "plan", "--data", str(data), "--max-bad-fraction", "0.5", *flags])
    for index in range(count):
        code = code or cli([*base, "--phase", "shard", "--shard-index", str(index), "--shard-count", str(count)])
    return code or cli([*base, "--phase", "finish", "--shard-count", str(count)])


def _bytes(run: Path) -> dict[str, bytes]:
    return {name: (run / "prepared" / name).read_bytes() for name in OUTPUTS}


def _pairs(run: Path, side: str) -> pa.Table:
    return pq.read_table(run / "prepared" / f"{side}_pairs.parquet")


def test_any_shard_count_gives_the_records_quarantine_and_split_of_one_prepare(upload, tmp_path):
    single = tmp_path / "single"
    assert cli(["prepare", "--run-dir", str(single), "--data", str(upload), "--max-bad-fraction", "0.5"]) == 0
    runs = {count: tmp_path / f"shards-{count}" for count in (1, 2, 3)}
    for count, run in runs.items():
        assert _sharded(run, upload, count) == 0
    plan_units = len(read_json(runs[1] / "prepared" / prepare_shards.SHARDS / prepare_shards.PLAN)["units"])
    assert plan_units >= 8  # several JSON Lines byte ranges and Parquet row groups
    reference = _bytes(single)
    for count, run in runs.items():
        got = _bytes(run)
        # The tokenizer, schema (pair labels included), catalog, pair arrays and quarantine (line
        # numbers included) are the single prepare's bytes ...
        for name in OUTPUTS:
            if not name.endswith("_pairs.parquet"):
                assert got[name] == reference[name], (count, name)
        # ... and the pair files hold the same rows in the same order (cut into other row groups).
        for side in ("train", "holdout"):
            assert _pairs(run, side).equals(_pairs(single, side)), (count, side)
        assert got == _bytes(runs[1]), count  # any shard count: byte-identical outputs
        report = read_json(run / "prepared" / "prepare.json")
        assert report["status"] == "ok" and report["shards"]["units"] == plan_units
        assert report["counts"] == read_json(single / "prepared" / "prepare.json")["counts"]
        # What stays in _shards/ after the finish is small: no second copy of the catalog arrays.
        assert not list((run / "prepared" / prepare_shards.SHARDS).glob("products.*.npy")), count
    schema = feature_schema.Schema.load(runs[3] / "prepared" / "schema.json")
    assert {"label-0", "label-1", "label-2"} <= set(schema.class_names)
    # Training reads the result: every train pair in the batches of one epoch.
    prepared = prepared_data.load_prepared(runs[3])
    batches = static_batches.TrainBatches(prepared, 16, rank=0, world_size=1, seed=0)
    rows = sum(int(batch["row_mask"].sum()) for batch in batches.epoch(0))
    assert rows == len(prepared.train) == len(prepared_data.load_prepared(single).train)


def test_a_rerun_with_the_same_count_is_byte_identical_and_finished_units_are_skipped(upload, tmp_path, caplog):
    run = tmp_path / "run"
    assert _sharded(run, upload, 2) == 0
    first = _bytes(run)
    assert not (run / "prepared" / prepare_shards.SHARDS / "units").exists()  # the bulk is removed after the finish
    assert _sharded(run, upload, 2) == 0
    assert _bytes(run) == first
    # A child rerun after its units are complete redoes nothing.
    args = ["prepare", "--run-dir", str(run), "--phase", "shard", "--shard-index", "1", "--shard-count", "2"]
    assert cli(args) == 0
    before = {p: p.stat().st_mtime_ns for p in (run / "prepared" / prepare_shards.SHARDS / "units").iterdir()}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline_steps.prepare"):
        assert prepare_shards.run_shard(run, 1, 2)["written"] == []
    assert "already complete" in caplog.text
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_killed_child_leaves_nothing_the_finish_accepts_and_its_rerun_completes(upload, tmp_path, caplog):
    reference = tmp_path / "reference"
    assert _sharded(reference, upload, 3) == 0
    run = tmp_path / "run"
    assert _sharded(run, upload, 3) == 0
    shards = run / "prepared" / prepare_shards.SHARDS
    plan = read_json(shards / prepare_shards.PLAN)
    for index in range(3):
        assert cli(["prepare", "--run-dir", str(run), "--phase", "shard", "--shard-index", str(index),
                    "--shard-count", "3"]) == 0
    # Child 1 killed while writing its first unit: the part renamed into place but cut short, a
    # temp file of the next write, and no sidecar yet (the sidecar is written last).
    unit = prepare_shards.shard_bounds(len(plan["units"]), 1, 3)[0]
    paths = prepare_shards.unit_paths(shards, unit)
    paths["sidecar"].unlink()
    paths["train"].write_bytes(paths["train"].read_bytes()[:100])
    stale = paths["holdout"].parent / f".{paths['holdout'].name}.k1ll3d.tmp"
    stale.write_bytes(b"half")
    (run / "prepared" / "prepare.json").unlink()
    caplog.clear()
    assert cli(["prepare", "--run-dir", str(run), "--phase", "finish", "--shard-count", "3"]) == ExitCode.BAD_INPUT
    assert f"{unit} (not written yet)" in caplog.text and "shards [1] of 3" in caplog.text
    with pytest.raises(prepare_shards.BadInputError):
        prepared_data.load_prepared(run)
    # A sidecar beside a file changed after it was written is not accepted either.
    other = prepare_shards.unit_paths(shards, unit + 1)["quarantine"]
    other.write_bytes(other.read_bytes() + b"\n")
    assert prepare_shards.unit_status(shards, plan["plan_id"], unit + 1) == f"{other.name} missing or modified"
    # The rerun of the child redoes exactly its broken units, and the finish gives the reference.
    assert unit + 1 < prepare_shards.shard_bounds(len(plan["units"]), 1, 3)[1]  # both in shard 1
    assert prepare_shards.run_shard(run, 1, 3)["written"] == [unit, unit + 1]
    assert not stale.exists()
    assert cli(["prepare", "--run-dir", str(run), "--phase", "finish", "--shard-count", "3"]) == 0
    assert _bytes(run) == _bytes(reference)


def test_too_many_bad_pairs_fail_the_finish_with_65_naming_the_files(upload, tmp_path, caplog):
    run = tmp_path / "run"
    base = ["prepare", "--run-dir", str(run)]
    # Too many bad products fail the plan already, before any child runs.
    caplog.clear()
    assert cli([*base, "--phase", "plan", "--data", str(upload)]) == ExitCode.BAD_INPUT
    assert "products records are bad" in caplog.text and "--max-bad-fraction" in caplog.text
    assert not (run / "prepared" / prepare_shards.SHARDS / prepare_shards.PLAN).exists()
    # A clean catalog and too many bad pairs: the finish fails and names what to fix.
    clean = tmp_path / "clean"
    shutil.copytree(upload, clean)
    products, _ = generate(60, 3, seed=0)
    (clean / "products" / "part-00000.jsonl").write_text("".join(json.dumps(p) + "\n" for p in products))
    assert cli([*base, "--phase", "plan", "--data", str(clean)]) == 0
    assert cli([*base, "--phase", "shard", "--shard-index", "0", "--shard-count", "1"]) == 0
    caplog.clear()
    assert cli([*base, "--phase", "finish"]) == ExitCode.BAD_INPUT == 65
    quarantine = run / "prepared" / "quarantine.jsonl"
    assert "pairs records are bad" in caplog.text and "max_bad_fraction 1.00%" in caplog.text
    assert str(quarantine) in caplog.text and "--max-bad-fraction" in caplog.text
    assert quarantine.read_text().count("\n") == len(BAD_PAIRS)
    report = read_json(run / "prepared" / "prepare.json")
    assert report["status"] == "failed" and report["counts"]["pairs"]["quarantined"] == len(BAD_PAIRS)
    # The flag the message names works on the finish alone: the units stay valid.
    assert cli([*base, "--phase", "finish", "--max-bad-fraction", "0.5"]) == 0
    assert read_json(run / "prepared" / "prepare.json")["data_config"]["max_bad_fraction"] == 0.5
    # An upload without any pair record: the finish names the files.
    (clean / "pairs" / "part-00000.jsonl").write_bytes(b"\n\n")
    (clean / "pairs" / "part-00001.parquet").unlink()
    assert cli([*base, "--phase", "plan", "--data", str(clean)]) == 0
    assert cli([*base, "--phase", "shard"]) == 0  # shard 0 of 1: every unit
    caplog.clear()
    assert cli([*base, "--phase", "finish"]) == ExitCode.BAD_INPUT
    assert "the pairs input holds no records" in caplog.text and "part-00000.jsonl" in caplog.text


def test_units_cover_every_line_once_whatever_the_line_lengths(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [b"\xef\xbb\xbf" + json.dumps({"query": "first", "product_id": "P1"}).encode()]
    lines += [json.dumps({"query": "q" * (i * 37 % 700), "product_id": f"P{i}"}).encode() for i in range(200)]
    lines[50] = b""  # a blank line holds no record, but counts as a line
    lines[60] = b'{"query": "broken'
    path.write_bytes(b"\r\n".join(lines))  # CRLF, and no newline after the last line
    units = prepare_shards.plan_units([path], unit_bytes=1000)
    assert len(units) > 20 and units[0]["start"] == 0 and units[-1]["end"] == path.stat().st_size
    assert all(a["end"] == b["start"] for a, b in zip(units, units[1:]))
    records, offset = [], 0
    for unit in units:
        reader = prepare_shards.unit_batches(unit)
        for batch in reader:
            records += [(r.line + offset, r.value, r.reason) for r in map(batch.raw_record, range(len(batch)))]
        offset += reader.lines
    expected = [(r.line, r.value, r.reason) for r in record_reading.iter_records([path])]
    assert records == expected and offset == len(lines)
    assert records[0][1] == {"query": "first", "product_id": "P1"}  # the BOM is dropped


def test_init_from_keeps_the_previous_tokenizer_and_schema(upload, tmp_path):
    first = tmp_path / "first"
    assert _sharded(first, upload, 2) == 0
    second = tmp_path / "second"
    assert _sharded(second, upload, 2, "--init-from", str(first)) == 0
    for name in ("tokenizer.json", "schema.json"):
        assert (second / "prepared" / name).read_bytes() == (first / "prepared" / name).read_bytes()
    np.testing.assert_array_equal(np.load(second / "prepared" / "train_pairs.class_id.npy"),
                                  np.load(first / "prepared" / "train_pairs.class_id.npy"))
