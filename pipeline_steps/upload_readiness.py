"""The upload contract, and waiting until an upload is complete on the file system.

An upload is `<dataset>/<version>/{products/..., pairs/..., _SUCCESS}`, the marker uploaded last and
best a manifest of the files (`manifest_for` writes one); a stage may name the marker otherwise
(PIPELINE_SUCCESS_MARKER). On AWS, prepare waits, bounded (then exit
75), until every file is visible on FSx with its full size. Why, and the manifest format:
docs/data.md, "Data readiness".
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline_contract import SUCCESS_MARKER, SUCCESS_MARKER_ENV

from .errors import BadInputError, RetryableError
from .fileio import sha256_file

log = logging.getLogger("pipeline_steps.upload")

# FSx for Lustre imports new S3 objects asynchronously, object by object, in no guaranteed order:
# the marker's event can arrive before the upload is visible on /fsx.
DOCS = "https://docs.aws.amazon.com/fsx/latest/LustreGuide/autoimport-data-repo-dra.html"


def success_marker(environ: Mapping[str, str] = os.environ) -> str:
    """The marker's name: the stage's (PIPELINE_SUCCESS_MARKER, set by the compute stack when it is
    not the default), else the contract's SUCCESS_MARKER."""
    return environ.get(SUCCESS_MARKER_ENV) or SUCCESS_MARKER


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    bytes: int
    sha256: str | None = None


def read_manifest(upload_dir: Path) -> list[ManifestEntry] | None:
    """The files the marker lists; None for an empty marker (no manifest). BadInputError when
    the marker holds something that is not a manifest."""
    marker = upload_dir / success_marker()
    text = marker.read_bytes()
    if not text.strip():
        return None
    try:
        files = json.loads(text)["files"]
        entries = [ManifestEntry(str(f["path"]), int(f["bytes"]), f.get("sha256")) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{marker} is neither empty nor a manifest ({exc!r}); expected "
                            f'{{"files": [{{"path": "products/part-00000.jsonl", "bytes": 1234}}, ...]}}') from None
    for entry in entries:
        if entry.path.startswith("/") or ".." in Path(entry.path).parts or entry.bytes < 0:
            raise BadInputError(f"{marker} lists {entry.path!r} ({entry.bytes} bytes): paths "
                                f"must be relative to the upload directory and sizes >= 0")
    return entries


def manifest_for(upload_dir: Path) -> dict:
    """The manifest of the files under `upload_dir` (hidden and `_` files excluded), to upload as
    its marker: what a data owner's export job writes last."""
    files = sorted(f for f in upload_dir.rglob("*") if f.is_file()
                   and not any(part.startswith((".", "_")) for part in f.relative_to(upload_dir).parts))
    return {"files": [{"path": f.relative_to(upload_dir).as_posix(), "bytes": f.stat().st_size,
                       "sha256": sha256_file(f)} for f in files]}


def _listing(upload_dir: Path) -> dict[str, int]:
    return {f.relative_to(upload_dir).as_posix(): f.stat().st_size
            for f in sorted(upload_dir.rglob("*")) if f.is_file()}


def missing_files(upload_dir: Path, previous: dict[str, int] | None,
                  on_fsx: bool = True) -> tuple[list[str], dict[str, int] | None]:
    """(what is not there yet, the listing to compare with next time); empty when complete.
    `on_fsx=False` (local data, nothing is imported): only a manifest, if any, is checked."""
    marker = upload_dir / success_marker()
    if not on_fsx and not marker.is_file():
        return [], None
    if not upload_dir.is_dir():
        return [f"{upload_dir} itself"], None
    if not marker.is_file():
        return [marker.name], None
    manifest = read_manifest(upload_dir)
    if manifest is None:
        if not on_fsx:
            return [], None
        listing = _listing(upload_dir)
        return ([] if listing == previous else ["a listing that stays unchanged for one poll interval"]), listing
    missing = []
    for entry in manifest:
        path = upload_dir / entry.path
        size = path.stat().st_size if path.is_file() else None
        if size != entry.bytes:
            missing.append(f"{entry.path} ({'absent' if size is None else f'{size} of {entry.bytes} bytes'})")
    return missing, None


def wait_for_upload(upload_dir: Path, timeout_s: float, poll_s: float = 10.0,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Return once every file of the upload is visible and complete; RetryableError (exit 75, Batch
    retries the job) when it is not after `timeout_s`. `timeout_s=0` is local data: no waiting,
    only the manifest in the marker, if there is one, is checked."""
    on_fsx = timeout_s > 0
    deadline = clock() + timeout_s
    missing, listing = missing_files(upload_dir, None, on_fsx)
    while missing:
        if clock() >= deadline:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise RetryableError(
                f"the upload {upload_dir} is not complete after {timeout_s:.0f} s (--upload-timeout): missing "
                f"{shown}. FSx for Lustre imports new S3 objects asynchronously ({DOCS}); a retry waits again. "
                f"If it never completes, check that every file was uploaded before {success_marker()} and that "
                f"its manifest matches the upload")
        log.info("waiting for the upload %s: missing %s", upload_dir, ", ".join(missing[:3]))
        sleep(poll_s)
        missing, listing = missing_files(upload_dir, listing, on_fsx)


def check_checksums(upload_dir: Path, checksums: dict[str, str]) -> None:
    """BadInputError when a file's sha256 (path -> hex digest, as prepare computed it) differs from
    the manifest's: the upload is damaged or the manifest is stale."""
    marker = success_marker()
    if not (upload_dir / marker).is_file():
        return
    for entry in read_manifest(upload_dir) or []:
        got = checksums.get(str(upload_dir / entry.path))
        if entry.sha256 and got and got != entry.sha256:
            raise BadInputError(f"{upload_dir / entry.path} has sha256 {got} but {marker} lists "
                                f"{entry.sha256}; re-upload the file (then {marker})")
