"""The `prepare` step: quarantine, the bad-record threshold, input errors, holdout split, --init-from."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_steps import feature_schema, prepared_data, record_reading, record_validation, tokenization
from pipeline_steps.__main__ import main as cli
from pipeline_steps.demo_data import generate
from pipeline_steps.errors import BadInputError, ExitCode
from pipeline_steps.fileio import read_json

REPO = Path(__file__).resolve().parents[2]

# (raw line, expected reason): one of each kind of bad product / pair record.
BAD_PRODUCTS = [
    (b'{"id": "bad1", "title": "unterminated', "malformed JSON"),
    (b'{"id": "bad2", "title": "caf\xe9 table"}', "invalid UTF-8"),
    (b'{"id": "bad3", "description": "no title"}', "missing field"),
    (b'{"id": "bad4", "title": 42}', "wrong type"),
    (b'{"id": "bad5", "title": "   "}', "empty text"),
    (json.dumps({"id": "bad6", "title": "x" * 5000}).encode(), "text too long"),
    (b'{"id": "bad7", "title": "lamp", "numeric": {"price": NaN}}', "non-finite number"),
    (b'{"id": "P000000", "title": "second definition of an id"}', "duplicate product id"),
    (b'["a", "list"]', "wrong type"),
    # Inputs that once escaped as a traceback: numbers without a float, lone surrogates, deep nesting.
    (b'{"id": "bad8", "title": "lamp", "numeric": {"price": 1e400}}', "number out of range"),
    (b'{"id": "bad9", "title": "lamp", "numeric": {"price": 1' + b"0" * 400 + b'}}', "number out of range"),
    (b'{"id": "bad10", "title": "lamp \\ud800"}', "invalid Unicode"),
    (b'{"id": "bad11", "title": "\\udc80", "numeric": {"price": NaN}}', "invalid Unicode"),
    (b'{"id": "bad12", "title": "lamp", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nesting too deep"),
]
BAD_PAIRS = [
    (b'{"query": "grey sofa", "product_id": "P000001", "weight": 0}', "non-positive weight"),
    (b'{"query": "grey sofa", "product_id": "P000001", "weight": -2.5}', "non-positive weight"),
    (b'{"query": "grey sofa", "product_id": "P000001", "weight": Infinity}', "non-finite number"),
    (b'{"query": "grey sofa", "product_id": "NOPE"}', "unknown product_id"),
    (b'{"query": "grey sofa", "product_id": "bad4"}', "unknown product_id"),  # its product was quarantined
    (b'{"product_id": "P000001"}', "missing field"),
    (b'{"query": "grey sofa", "product_id": 7}', "wrong type"),
    (b'{"query": "grey sofa", "product_id": "P000001", "weight": 1' + b"0" * 5000 + b'}', "number out of range"),
    (b'{"query": "", "product_id": "P000001"}', "empty text"),
]


def _write_jsonl(path: Path, good: list[dict], bad: list[tuple[bytes, str]]) -> dict[int, str]:
    """Good records, with the bad ones interleaved; returns {line number: expected reason}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines, expected = [], {}
    bad_iter = iter(bad)
    for i, record in enumerate(good):
        lines.append(json.dumps(record).encode())
        if i % 5 == 2 and (item := next(bad_iter, None)):
            lines.append(item[0])
            expected[len(lines)] = item[1]
    for raw, reason in bad_iter:
        lines.append(raw)
        expected[len(lines)] = reason
    path.write_bytes(b"\n".join(lines) + b"\n\n")  # a trailing blank line is not a record
    return expected


@pytest.fixture
def dirty_input(tmp_path) -> dict:
    products, pairs = generate(60, 3, seed=0)
    data = tmp_path / "upload"
    return {"data": data, "products": products, "pairs": pairs,
            "bad_products": _write_jsonl(data / "products" / "part-00000.jsonl", products, BAD_PRODUCTS),
            "bad_pairs": _write_jsonl(data / "pairs" / "part-00000.jsonl", pairs, BAD_PAIRS)}


def _prepare(run_dir: Path, *args: str) -> int:
    return cli(["prepare", "--run-dir", str(run_dir), *args])


def test_each_bad_record_is_quarantined_with_its_reason_and_line(dirty_input, tmp_path):
    run = tmp_path / "run"
    assert _prepare(run, "--data", str(dirty_input["data"]), "--max-bad-fraction", "0.5") == 0
    entries = [json.loads(line) for line in (run / "prepared" / "quarantine.jsonl").read_text().splitlines()]
    got = {(Path(e["source"]).parent.name, e["line"]): e["reason"] for e in entries}
    expected = {("products", n): r for n, r in dirty_input["bad_products"].items()}
    expected |= {("pairs", n): r for n, r in dirty_input["bad_pairs"].items()}
    assert got == expected
    assert all(e["record"] and e["detail"] for e in entries)
    assert max(len(e["record"]) for e in entries) <= 1000  # the 5000-character title is truncated
    report = read_json(run / "prepared" / "prepare.json")
    assert report["status"] == "ok"
    assert report["counts"]["products"]["reasons"]["wrong type"] == 2
    assert set(report["counts"]["products"]["reasons"]) | set(report["counts"]["pairs"]["reasons"]) \
        <= set(record_reading.QUARANTINE_REASONS)
    assert report["counts"]["pairs"]["reasons"]["unknown product_id"] == 2
    # No good record is dropped: every product and pair of the clean data is in the prepared set.
    prepared = prepared_data.load_prepared(run)
    assert sorted(prepared.products.ids) == sorted(p["id"] for p in dirty_input["products"])
    assert len(prepared.train) + len(prepared.holdout) == len(dirty_input["pairs"])
    assert report["counts"]["pairs"]["good"] == len(dirty_input["pairs"])


def test_too_many_bad_records_fail_with_exit_65_and_a_fix_it(dirty_input, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pipeline_steps", "prepare", "--run-dir", str(run),
                           "--data", str(dirty_input["data"])], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == ExitCode.BAD_INPUT == 65, proc.stderr
    assert "max_bad_fraction 1.00%" in proc.stderr and "--max-bad-fraction" in proc.stderr
    assert str(run / "prepared" / "quarantine.jsonl") in proc.stderr
    report = read_json(run / "prepared" / "prepare.json")
    assert report["status"] == "failed" and report["counts"]["products"]["quarantined"] == len(BAD_PRODUCTS)
    assert (run / "prepared" / "quarantine.jsonl").read_text().count("\n") == len(BAD_PRODUCTS) + len(BAD_PAIRS)
    with pytest.raises(BadInputError, match="did not succeed"):
        prepared_data.load_prepared(run)


def test_a_failed_rerun_does_not_leave_the_old_outputs_marked_ok(dirty_input, tmp_path):
    run = tmp_path / "run"
    assert _prepare(run, "--demo") == 0
    assert _prepare(run, "--data", str(dirty_input["data"])) == ExitCode.BAD_INPUT
    with pytest.raises(BadInputError):
        prepared_data.load_prepared(run)


def test_missing_or_empty_input_is_a_clear_error(tmp_path, caplog):
    run = tmp_path / "run"
    assert _prepare(run, "--products", str(tmp_path / "nope"), "--pairs", str(tmp_path / "nope")) == 65
    assert "does not exist" in caplog.text
    (tmp_path / "empty" / "products").mkdir(parents=True)
    (tmp_path / "empty" / "pairs").mkdir()
    assert _prepare(run, "--data", str(tmp_path / "empty")) == 65
    assert "is empty" in caplog.text
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "products.jsonl").write_text("\n\n")
    (tmp_path / "blank" / "pairs.jsonl").write_text("")
    assert _prepare(run, "--data", str(tmp_path / "blank")) == 65
    assert "holds no records" in caplog.text
    assert _prepare(run, "--data", str(tmp_path / "missing-dir")) == 65


def test_an_empty_input_file_is_named_in_the_error(tmp_path, caplog):
    products, pairs = generate(20, 2, seed=0)
    _write_jsonl(tmp_path / "in" / "products.jsonl", products, [])
    (tmp_path / "in" / "pairs.jsonl").write_bytes(b"")
    assert _prepare(tmp_path / "run", "--products", str(tmp_path / "in" / "products.jsonl"),
                    "--pairs", str(tmp_path / "in" / "pairs.jsonl")) == 65
    assert f"holds no records: {tmp_path / 'in' / 'pairs.jsonl'}" in caplog.text


def test_files_with_another_suffix_are_read_as_json_lines_or_named_in_the_error(tmp_path, caplog):
    products, pairs = generate(40, 2, seed=1)
    data = tmp_path / "upload"
    _write_jsonl(data / "products" / "part-00000.json", products[:20], [])  # Spark's JSON writer: JSON Lines
    _write_jsonl(data / "products" / "part-00001", products[20:], [])
    _write_jsonl(data / "pairs" / "part-00000.jsonl", pairs, [])
    assert _prepare(tmp_path / "run", "--data", str(data)) == 0
    assert read_json(tmp_path / "run" / "prepared" / "prepare.json")["counts"]["products"]["good"] == 40

    (data / "pairs" / "part-00001.csv").write_text("query,product_id\ngrey sofa,P000001\n")
    assert _prepare(tmp_path / "run", "--data", str(data)) == 65
    assert f"{data / 'pairs' / 'part-00001.csv'} is neither JSON Lines nor Parquet" in caplog.text


def test_parquet_inputs_are_validated_with_row_numbers(tmp_path):
    products, pairs = generate(40, 2, seed=5)
    products[3] = {**products[3], "title": None}  # a null in a Parquet column is a missing field
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(products), tmp_path / "in" / "products.parquet")
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "in" / "pairs.parquet")
    run = tmp_path / "run"
    assert _prepare(run, "--products", str(tmp_path / "in" / "products.parquet"),
                    "--pairs", str(tmp_path / "in" / "pairs.parquet"), "--max-bad-fraction", "0.2") == 0
    entries = [json.loads(line) for line in (run / "prepared" / "quarantine.jsonl").read_text().splitlines()]
    product_entries = [e for e in entries if e["kind"] == "products"]
    assert [(e["line"], e["reason"]) for e in product_entries] == [(4, "missing field")]
    assert {e["reason"] for e in entries if e["kind"] == "pairs"} <= {"unknown product_id"}
    prepared = prepared_data.load_prepared(run)
    # The struct-typed numeric column is read as features (price, rating, reviews).
    assert prepared.schema.numeric_names == ("price", "rating", "reviews")
    assert len(prepared.products) == 39


def _split(run: Path) -> tuple[set[str], set[str]]:
    prepared = prepared_data.load_prepared(run)
    return ({tokenization.normalise_query(q) for q in prepared.train.queries},
            {tokenization.normalise_query(q) for q in prepared.holdout.queries})


def test_holdout_split_is_deterministic_and_shares_no_query_with_train(tmp_path):
    for name in ("a", "b"):
        assert _prepare(tmp_path / name, "--demo", "--seed", "0") == 0
    train_a, holdout_a = _split(tmp_path / "a")
    assert (train_a, holdout_a) == _split(tmp_path / "b")
    # A rerun (e.g. a Batch retry) reproduces every output, the tokenizer included.
    for name in ("tokenizer.json", "products.parquet", "train_pairs.parquet", "holdout_pairs.parquet",
                 "train_pairs.token_ids.npy", "holdout_pairs.token_ids.npy"):
        assert (tmp_path / "a" / "prepared" / name).read_bytes() == (tmp_path / "b" / "prepared" / name).read_bytes()
    assert holdout_a and not train_a & holdout_a
    fraction = len(holdout_a) / (len(train_a) + len(holdout_a))
    assert 0.03 < fraction < 0.2  # tiny's holdout_fraction is 0.1
    assert _prepare(tmp_path / "c", "--demo", "--seed", "1") == 0
    assert _split(tmp_path / "c")[1] != holdout_a


def test_init_from_reuses_the_tokenizer_and_schema_byte_identical(tmp_path):
    first = tmp_path / "first"
    assert _prepare(first, "--demo") == 0
    # The next data version: other products (seed 7), a brand the first run never saw.
    products, pairs = generate(50, 2, seed=7)
    products[0]["categorical"]["brand"] = "Neverseen"
    data = tmp_path / "v2"
    _write_jsonl(data / "products.jsonl", products, [])
    _write_jsonl(data / "pairs.jsonl", pairs, [])

    second = tmp_path / "second"
    assert _prepare(second, "--data", str(data), "--init-from", str(first)) == 0
    for name in ("tokenizer.json", "schema.json"):
        assert (second / "prepared" / name).read_bytes() == (first / "prepared" / name).read_bytes()
    prepared = prepared_data.load_prepared(second)
    brand = prepared.schema.categorical_names.index("brand")
    assert prepared.products.categorical[0, brand] == 0  # unseen category -> unknown id
    report = read_json(second / "prepared" / "prepare.json")
    assert report["tokenizer"]["source"] == str(first / "prepared")
    assert report["schema_coverage"]["unknown_categorical_values"]["brand"] >= 1

    # Without --init-from the tokenizer is retrained on the new data and differs.
    fresh = tmp_path / "fresh"
    assert _prepare(fresh, "--data", str(data)) == 0
    assert (fresh / "prepared" / "tokenizer.json").read_bytes() != (first / "prepared" / "tokenizer.json").read_bytes()


def _checkpoint_from(run: Path, checkpoint_run: Path) -> Path:
    """A checkpoint holding `run`'s tokenizer and schema, stored the way the train step does."""
    from pipeline_steps import checkpoint

    tokenizer_json = (run / "prepared" / "tokenizer.json").read_text("utf-8")
    state = {"format_version": 1, "step": 1, "epoch": 0, "batch_in_epoch": 1,
             "tokenizer": {"json": tokenizer_json, "sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest()},
             "schema": read_json(run / "prepared" / "schema.json")}
    return checkpoint.save(checkpoint_run, state, keep=2)


def test_init_from_a_checkpoint_reuses_its_tokenizer(tmp_path):
    first = tmp_path / "first"
    assert _prepare(first, "--demo") == 0
    ckpt = _checkpoint_from(first, tmp_path / "trained")
    # A checkpoint file, and a run dir that holds only checkpoints (its latest one is used).
    for i, init_from in enumerate((ckpt, tmp_path / "trained")):
        second = tmp_path / f"second{i}"
        assert _prepare(second, "--demo", "--seed", "3", "--init-from", str(init_from)) == 0
        tokenizer = (second / "prepared" / "tokenizer.json").read_bytes()
        assert tokenizer == (first / "prepared" / "tokenizer.json").read_bytes()
        assert feature_schema.Schema.load(second / "prepared" / "schema.json") == feature_schema.Schema.load(first / "prepared" / "schema.json")


def test_init_from_a_run_without_prepared_data_is_a_clear_error(tmp_path, caplog):
    (tmp_path / "old").mkdir()
    assert _prepare(tmp_path / "run", "--demo", "--init-from", str(tmp_path / "old")) == 65
    assert "tokenizer.json" in caplog.text and "checkpoint" in caplog.text


def test_pairs_are_streamed_in_chunks_without_changing_the_result(tmp_path, monkeypatch):
    """Memory holds one chunk of pairs at a time (one Parquet row group per chunk and side); the
    chunk size changes nothing in what is prepared."""
    from pipeline_steps import preparing

    assert _prepare(tmp_path / "whole", "--demo") == 0
    monkeypatch.setattr(preparing, "PAIR_CHUNK", 50)
    assert _prepare(tmp_path / "chunked", "--demo") == 0
    for name in ("train_pairs.parquet", "holdout_pairs.parquet"):
        chunked = pq.ParquetFile(tmp_path / "chunked" / "prepared" / name)
        assert max(chunked.metadata.row_group(i).num_rows for i in range(chunked.num_row_groups)) <= 50
        assert chunked.read().equals(pq.read_table(tmp_path / "whole" / "prepared" / name))
    arrays = [prepared_data.pair_array_path(Path(), side, column).name for side in ("train", "holdout") for column in prepared_data.PAIR_ARRAYS]
    for name in ("tokenizer.json", "schema.json", "products.parquet", "quarantine.jsonl", *arrays):
        assert (tmp_path / "chunked" / "prepared" / name).read_bytes() == (tmp_path / "whole" / "prepared" / name).read_bytes()
    assert not (tmp_path / "chunked" / "prepared" / "_work").exists()


def test_worker_processes_prepare_the_same_files_as_one_process(dirty_input, tmp_path, monkeypatch):
    """Worker processes validate the pair files and tokenise the chunks of pairs (one per CPU): with
    bad records in three pair files and chunks that span them, one, two and three workers write
    the same files, the quarantine's records in input order included; and but for the quarantine's
    file names and lines, the files of the same records in one pair file."""
    from pipeline_steps import preparing, worker_pool

    monkeypatch.setattr(preparing, "PAIR_CHUNK", 37)
    assert _prepare(tmp_path / "one-file", "--data", str(dirty_input["data"]), "--max-bad-fraction", "0.5") == 0
    pairs = dirty_input["data"] / "pairs"
    lines = (pairs / "part-00000.jsonl").read_bytes().splitlines(keepends=True)
    third = len(lines) // 3
    for i in range(3):
        (pairs / f"part-{i:05d}.jsonl").write_bytes(b"".join(lines[i * third:(i + 1) * third if i < 2 else None]))
    for workers in (1, 2, 3):
        monkeypatch.setattr(worker_pool, "worker_count", lambda count=workers: count)
        assert _prepare(tmp_path / f"w{workers}", "--data", str(dirty_input["data"]), "--max-bad-fraction", "0.5") == 0
    one = tmp_path / "w1" / "prepared"
    names = sorted(p.name for p in one.iterdir() if p.is_file() and p.name != "prepare.json")
    assert {"quarantine.jsonl", "train_pairs.parquet", "train_pairs.token_ids.npy"} <= set(names)
    assert len((one / "quarantine.jsonl").read_text().splitlines()) == len(BAD_PRODUCTS) + len(BAD_PAIRS)
    for run in ("w2", "w3", "one-file"):
        for name in names:
            if run != "one-file" or name != "quarantine.jsonl":
                assert (tmp_path / run / "prepared" / name).read_bytes() == (one / name).read_bytes(), (run, name)


def test_workers_follow_the_cpus_a_container_may_use(tmp_path, monkeypatch):
    """A container's CPU quota (an AWS Batch job's vCPUs on a larger instance) bounds the workers,
    not the host's CPU count."""
    from pipeline_steps import worker_pool

    monkeypatch.setattr(worker_pool.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(worker_pool, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert worker_pool.available_cpus() == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert worker_pool.available_cpus() == 64
    assert worker_pool.worker_count() == worker_pool.MAX_WORKERS


def test_prepare_never_imports_torch(tmp_path):
    """Prepare needs no torch; importing it (its tracking hook once did) costs ~0.9 GB of RSS."""
    probe = ("import sys; from pipeline_steps.__main__ import main\n"
             f"assert main(['prepare', '--run-dir', {str(tmp_path / 'run')!r}, '--demo']) == 0\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_catalog_texts_are_chunked_without_changing_the_result(tmp_path, monkeypatch):
    """The catalog's texts are held in Arrow chunks of TEXT_CHUNK rows, a multiple of Parquet's
    write batch, with bad records among them: products.parquet is the file one contiguous column
    gives (chunks of another size cut its pages elsewhere)."""
    from pipeline_steps import preparing

    products, pairs = generate(2600, 1, seed=0)
    for i, record in enumerate(products):  # 2.6 MB of text: more than one Parquet data page
        record["description"] = f"{record.get('description', '')} item {i} " + "long description " * 55
    data = tmp_path / "upload"
    (data / "products").mkdir(parents=True)
    lines = [json.dumps(r) for r in products]
    lines[700:700] = ['{"id": "bad", "title": 42}', "not json"]  # the chunks are not cut at batch edges
    (data / "products" / "part-00000.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.Table.from_pylist(pairs), data / "pairs.parquet")
    monkeypatch.setattr(preparing, "TEXT_CHUNK", 1 << 20)
    assert _prepare(tmp_path / "whole", "--data", str(data)) == 0
    monkeypatch.setattr(preparing, "TEXT_CHUNK", 1024)
    assert _prepare(tmp_path / "chunked", "--data", str(data)) == 0
    names = sorted(p.name for p in (tmp_path / "whole" / "prepared").iterdir() if p.name != "prepare.json")
    assert "products.parquet" in names
    for name in names:
        assert (tmp_path / "chunked" / "prepared" / name).read_bytes() == (tmp_path / "whole" / "prepared" / name).read_bytes()


def test_a_catalog_without_numeric_or_categorical_features_is_prepared(tmp_path):
    products, pairs = generate(120, 3, seed=0)
    for record in products:
        del record["numeric"], record["categorical"]
    for kind, records in (("products", products), ("pairs", pairs)):
        (tmp_path / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = tmp_path / "run"
    assert _prepare(run, "--products", str(tmp_path / "products.jsonl"), "--pairs", str(tmp_path / "pairs.jsonl")) == 0
    assert read_json(run / "prepared" / "prepare.json")["schema"] == {"numeric": 0, "categorical": [],
                                                                    "classes": len({p["category"] for p in products})}
    assert prepared_data.load_prepared(run).products.numeric.shape == (120, 0)


def _split_and_join(text: str) -> str:
    return " ".join(text.split())


def _normalise_query_per_character(text: str) -> str:
    import unicodedata

    decomposed = unicodedata.normalize("NFKD", text)
    return " ".join("".join(c for c in decomposed if not unicodedata.combining(c)).lower().split())


def _continuing_subwords_of_whole_texts(tokenizer, texts, chunk: int = 10_000) -> list[str]:
    import unicodedata

    chars: set[str] = set()
    for start in range(0, len(texts), chunk):
        chars.update(tokenizer.normalizer.normalize_str("\n".join(texts[start:start + chunk])))
    inside = (c for c in chars if not c.isspace() and not unicodedata.category(c).startswith("P"))
    return ["##" + c for c in sorted(inside)]


ODD_TEXTS = ["tab\there", "line\nbreak\r\n", "vt\x0bff\x0c", "fs\x1cgs\x1drs\x1eus\x1f", "del\x7fete",
             "nb\u00a0sp", "em\u2003space\u3000ideo", "zero\u200bwidth", "caf\u00e9 cre\u0301me", "\u0301 \u0308 \u0327",
             "\u039f\u0394\u039f\u03a3 \u03a3\u039f\u03a6\u0391\u03a3", "\u5317\u4eac\u4e1c\u897f",
             "sofa \U0001F6CB\u2615", "\u0434\u0438\u0432\u0430\u043d", "  lead and trail  ", "\ufb01ne ligature",
             "\u0130stanbul"]


def test_prepare_gives_the_same_files_as_the_plain_implementations_on_odd_text(tmp_path, monkeypatch):
    """Whitespace collapsing, encoding by words (with its cache and its cut of long texts), the
    accent-stripping of queries, the tokenizer's seed characters and its training on word counts
    all have fast paths: on text with
    every kind of whitespace, control characters, accents, scripts and long descriptions, prepare
    writes the same files as with the plain implementations (split and join, whole-text encoding,
    per-character loops)."""
    products, pairs = generate(150, 4, seed=1)
    rng = random.Random(0)
    for i, record in enumerate(products):
        odd = [rng.choice(ODD_TEXTS) for _ in range(3)]
        record["title"] = f"{odd[0]} {record['title']}"
        lead = "\u0301 " * 40 if i % 7 == 0 else ""  # first words without a token: the row reads on
        record["description"] = lead + f" {odd[1]} ".join([record.get("description", "")] * (1 + i % 6)) + odd[2]
    for i, pair in enumerate(pairs):
        pair["query"] = f"{pair['query']} {ODD_TEXTS[i % len(ODD_TEXTS)]}"
    data = tmp_path / "upload"
    for kind, records in (("products", products), ("pairs", pairs)):
        (data / kind).mkdir(parents=True)
        (data / kind / "part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _prepare(tmp_path / "fast", "--data", str(data)) == 0
    monkeypatch.setattr(record_validation, "collapse_spaces", _split_and_join)
    monkeypatch.setattr(tokenization.WordEncoder, "of", classmethod(lambda cls, tokenizer, max_length: None))
    monkeypatch.setattr(tokenization, "normalise_query", _normalise_query_per_character)
    monkeypatch.setattr(tokenization, "_continuing_subword_tokens", _continuing_subwords_of_whole_texts)
    monkeypatch.setattr(tokenization, "_word_feed", lambda texts, max_words: texts)
    assert _prepare(tmp_path / "plain", "--data", str(data)) == 0
    fast, plain = tmp_path / "fast" / "prepared", tmp_path / "plain" / "prepared"
    names = sorted(p.name for p in fast.iterdir() if p.is_file() and p.name != "prepare.json")
    assert {"products.parquet", "tokenizer.json"} <= set(names)
    assert names == sorted(p.name for p in plain.iterdir() if p.is_file() and p.name != "prepare.json")
    for name in names:
        assert (fast / name).read_bytes() == (plain / name).read_bytes(), name


def test_the_tokenizer_learns_the_most_frequent_words_of_a_large_vocabulary():
    """A sample with more distinct words than the tokenizer learns from (TOKENIZER_WORDS; its merge
    loop costs time per distinct word) trains on the most frequent: they become whole tokens, the
    rarest are left to the pieces; under the bound the vocabulary is the same as from every word."""
    frequent = ["sofa", "table", "lamp", "chair", "rug"]
    rare = [f"zq{chr(97 + i // 26)}{chr(97 + i % 26)}x" for i in range(300)]
    texts = [" ".join(frequent)] * 20 + [f"{w} {w}" for w in rare[:150]] + rare[150:]
    vocab = tokenization.train_tokenizer(texts, 2000, max_words=len(frequent) + 150).get_vocab()
    assert set(frequent) <= set(vocab)
    assert not set(rare[150:]) & set(vocab)
    assert tokenization.train_tokenizer(texts, 2000, max_words=len(frequent) + 300).get_vocab() == \
        tokenization.train_tokenizer(texts, 2000, max_words=10**9).get_vocab()


def test_the_tokenizer_learns_from_a_sample_bounded_in_characters(tmp_path, monkeypatch):
    """Long descriptions do not make the tokenizer's training grow with the catalog: each half of its
    sample (products, training queries) holds at most TOKENIZER_SAMPLE_CHARS characters."""
    from pipeline_steps import preparing

    products, pairs = generate(300, 3, seed=0)
    for record in products:
        record["description"] = f"{record.get('description', '')} " * 20
    data = tmp_path / "upload"
    for kind, records in (("products", products), ("pairs", pairs)):
        (data / kind).mkdir(parents=True)
        (data / kind / "part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    learned: list[list[str]] = []
    train_tokenizer = tokenization.train_tokenizer
    monkeypatch.setattr(tokenization, "train_tokenizer",
                        lambda texts, size: learned.append(texts) or train_tokenizer(texts, size))
    monkeypatch.setattr(preparing, "TOKENIZER_SAMPLE_CHARS", 5_000)
    assert _prepare(tmp_path / "run", "--data", str(data)) == 0
    texts = {record_validation.collapse_spaces(f"{p['title']} {p.get('description', '')}") for p in products}
    sampled_products = [t for t in learned[0] if t in texts]
    sampled_queries = [t for t in learned[0] if t not in texts]
    assert 0 < sum(map(len, sampled_products)) <= 5_000 < sum(map(len, texts))
    queries = {p["query"] for p in pairs}
    assert 0 < sum(map(len, sampled_queries)) <= 5_000 < sum(map(len, queries))
    assert len(sampled_products) < len(products)
