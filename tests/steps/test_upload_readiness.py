"""Data readiness: prepare waits for an upload that FSx for Lustre is still importing, bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline_contract import SUCCESS_MARKER, SUCCESS_MARKER_ENV
from pipeline_steps import upload_readiness
from pipeline_steps.__main__ import main as cli
from pipeline_steps.demo_data import generate
from pipeline_steps.errors import BadInputError, ExitCode, RetryableError
from pipeline_steps.steps.prepare import main as prepare_main


def _upload(root: Path) -> tuple[Path, dict[str, bytes]]:
    """A complete upload in a staging dir: its files (by relative path) and its manifest marker."""
    products, pairs = generate(40, 2, seed=0)
    files = {"products/part-00000.jsonl": b"".join(json.dumps(p).encode() + b"\n" for p in products[:20]),
             "products/part-00001.jsonl": b"".join(json.dumps(p).encode() + b"\n" for p in products[20:]),
             "pairs/part-00000.jsonl": b"".join(json.dumps(p).encode() + b"\n" for p in pairs)}
    staging = root / "staging"
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    files[SUCCESS_MARKER] = json.dumps(upload_readiness.manifest_for(staging)).encode()
    return staging, files


class FakeImport:
    """Stands in for FSx auto-import: each poll makes one more object visible, in an order that is
    not the upload order (the marker first), and a file first appears with only part of its bytes."""

    def __init__(self, target: Path, files: dict[str, bytes]):
        self.target, self.polls = target, 0
        data = sorted(k for k in files if k != SUCCESS_MARKER)
        marker = [(SUCCESS_MARKER, files[SUCCESS_MARKER])] if SUCCESS_MARKER in files else []
        partial = [(rel, files[rel][: len(files[rel]) // 2]) for rel in data[:1]]
        self.steps = marker + partial + [(rel, files[rel]) for rel in data]

    def sleep(self, seconds: float) -> None:
        self.polls += 1
        if self.steps:
            rel, data = self.steps.pop(0)
            (self.target / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.target / rel).write_bytes(data)

    def clock(self) -> float:
        return float(self.polls)  # one "second" per poll: no real time passes in this test


def test_prepare_waits_until_every_file_of_the_manifest_is_imported(tmp_path):
    _, files = _upload(tmp_path)
    target = tmp_path / "fsx" / "incoming" / "catalog" / "v1"
    fake = FakeImport(target, files)
    upload_readiness.wait_for_upload(target, timeout_s=100, poll_s=1, sleep=fake.sleep, clock=fake.clock)
    # Returned only when the last object was there with its full size, not at the marker.
    assert not fake.steps and fake.polls == len(files) + 1
    assert {rel: (target / rel).read_bytes() for rel in files} == files


def test_an_upload_still_incomplete_at_the_bound_exits_75_naming_what_is_missing(tmp_path, caplog):
    staging, files = _upload(tmp_path)
    (staging / SUCCESS_MARKER).write_bytes(files[SUCCESS_MARKER])
    (staging / "pairs" / "part-00000.jsonl").unlink()  # not imported yet
    (staging / "products" / "part-00001.jsonl").write_bytes(files["products/part-00001.jsonl"][:10])
    fake = FakeImport(staging, {})
    with pytest.raises(RetryableError, match=r"missing pairs/part-00000.jsonl \(absent\), "
                                             r"products/part-00001.jsonl \(10 of \d+ bytes\)"):
        upload_readiness.wait_for_upload(staging, timeout_s=5, poll_s=1, sleep=fake.sleep, clock=fake.clock)
    assert fake.polls == 5
    # Through the step: exit 75, which the Batch retry strategy retries; the message names the flag.
    code = cli(["prepare", "--run-dir", str(tmp_path / "run"), "--data", str(staging)])
    assert code == ExitCode.RETRYABLE == 75
    assert "--upload-timeout" in caplog.text and "pairs/part-00000.jsonl (absent)" in caplog.text


def test_a_complete_upload_with_its_manifest_prepares(tmp_path):
    staging, files = _upload(tmp_path)
    (staging / SUCCESS_MARKER).write_bytes(files[SUCCESS_MARKER])
    assert prepare_main(["--run-dir", str(tmp_path / "run"), "--data", str(staging), "--upload-timeout", "60"]) == 0


def test_an_empty_marker_waits_for_a_listing_that_stops_changing(tmp_path):
    _, files = _upload(tmp_path)
    files[SUCCESS_MARKER] = b""
    target = tmp_path / "fsx"
    fake = FakeImport(target, files)
    upload_readiness.wait_for_upload(target, timeout_s=100, poll_s=1, sleep=fake.sleep, clock=fake.clock)
    assert not fake.steps and fake.polls == len(files) + 2  # one more poll: the listing is unchanged


def test_a_file_whose_checksum_differs_from_the_manifest_is_bad_input(tmp_path, caplog):
    staging, files = _upload(tmp_path)
    manifest = json.loads(files[SUCCESS_MARKER])
    manifest["files"][0]["sha256"] = "0" * 64
    (staging / SUCCESS_MARKER).write_text(json.dumps(manifest))
    with pytest.raises(BadInputError, match="re-upload"):
        prepare_main(["--run-dir", str(tmp_path / "run"), "--data", str(staging)])


def test_a_marker_that_is_not_a_manifest_is_bad_input(tmp_path):
    (tmp_path / SUCCESS_MARKER).write_text("done")
    with pytest.raises(BadInputError, match="neither empty nor a manifest"):
        upload_readiness.wait_for_upload(tmp_path, timeout_s=0)


def test_the_stage_s_marker_is_the_one_prepare_waits_for(tmp_path, monkeypatch):
    """A stage whose trigger fires on another marker (PipelineConfig.success_marker) passes it to the
    jobs; prepare then waits for that object, and a default-named one does not end the wait."""
    staging, files = _upload(tmp_path)
    (staging / SUCCESS_MARKER).write_bytes(files[SUCCESS_MARKER])
    monkeypatch.setenv(SUCCESS_MARKER_ENV, "_DONE")
    fake = FakeImport(staging, {})
    with pytest.raises(RetryableError, match="missing _DONE"):
        upload_readiness.wait_for_upload(staging, timeout_s=3, poll_s=1, sleep=fake.sleep, clock=fake.clock)
    (staging / SUCCESS_MARKER).rename(staging / "_DONE")
    upload_readiness.wait_for_upload(staging, timeout_s=3, poll_s=1, sleep=fake.sleep, clock=fake.clock)
