"""Reading input records: JSON Lines (*.jsonl, *.ndjson) or Parquet, a file or a directory of shards
(recursively, sorted; paths with a part starting with "." or "_", such as `_SUCCESS`, are skipped),
in batches, with the quarantine reasons of lines that are not records. docs/data.md, "Inputs"."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline_contract import FSX_INCOMING

from .errors import BadInputError

log = logging.getLogger("pipeline_steps.data")  # one logger for the data layer

_BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some editors write first

INPUT_SUFFIXES = (".jsonl", ".ndjson", ".parquet")

PAD_ID = 0


QUARANTINE_REASONS: dict[str, str] = {
    "invalid UTF-8": "a line that is not valid UTF-8 (each line is decoded on its own)",
    "invalid Unicode": "a lone surrogate escape such as \\ud800, which no UTF-8 text can hold",
    "malformed JSON": "a truncated or broken line",
    "number out of range": "a number too large for a 64-bit float, such as 1e400",
    "nesting too deep": "arrays or objects nested deeper than 1024 levels",
    "missing field": "no title, no query, ...",
    "wrong type": "\"title\": 42, or a line that is not a JSON object",
    "empty text": "a title/query/id that is empty or only whitespace",
    "text too long": "a field longer than max_text_chars characters",
    "non-finite number": "NaN / Infinity in numeric or weight",
    "non-positive weight": "weight <= 0",
    "duplicate product id": "a second product with an id seen before (the first one is kept)",
    "unknown product_id": "a pair whose product is missing from the catalog or was quarantined",
}
"""Every reason a record can be quarantined for (docs/data.md lists the same table)."""


@dataclass(slots=True)  # built once per record: slots make that ~2x cheaper than frozen
class RawRecord:
    """One line (JSON Lines) or row (Parquet) of an input file, parsed or with the parse failure."""

    source: str
    line: int
    """1-based line number (JSON Lines) or row number (Parquet) in `source`."""
    value: dict[str, Any] | None
    raw: bytes | None = None
    """The line as read (JSON Lines); None for Parquet rows (rebuilt from `value` when needed)."""
    reason: str | None = None
    detail: str | None = None

    def raw_text(self) -> str:
        if self.raw is not None:
            return self.raw.decode("utf-8", "backslashreplace")
        return json.dumps(self.value, sort_keys=True, default=str)


def _sniff_format(path: Path) -> str | None:
    """"parquet" or "jsonl" for a file whose name does not say, judged by its content (Parquet's
    magic bytes, or a first non-blank line that is a JSON object); None when it is neither."""
    with open(path, "rb") as fh:
        head = fh.read(4)
        if head == b"PAR1":
            return "parquet"
        fh.seek(0)
        for line in fh:
            if line.strip():
                try:
                    return "jsonl" if isinstance(orjson.loads(line), dict) else None
                except orjson.JSONDecodeError:
                    return None
    return None


def input_format(path: Path) -> str:
    """"parquet" or "jsonl": by suffix, else by content; BadInputError naming the file otherwise."""
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    found = _sniff_format(path)
    if found is None:
        raise BadInputError(f"input file {path} is neither JSON Lines nor Parquet (prepare reads "
                            f"{', '.join(INPUT_SUFFIXES)}, and JSON Lines under any other name); convert it "
                            f"(decompress .gz, one JSON object per line) or remove it from the upload")
    return found


def list_input_files(path: str | Path) -> list[Path]:
    """The input files at `path` (a file, or a directory read recursively), sorted. A file with
    another suffix is read when its content is JSON Lines or Parquet, else it is an error."""
    p = Path(path)
    if not p.exists():
        raise BadInputError(f"input path {p} does not exist; check the path (on AWS: the upload's "
                            f"prefix under {FSX_INCOMING}/)")
    if p.is_file():
        input_format(p)
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file()
                   and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
    if not files:
        raise BadInputError(f"input directory {p} is empty: no {', '.join(INPUT_SUFFIXES)} files in it "
                            f"(or below); upload the shards first")
    for f in files:
        input_format(f)  # fail before any work when one file of the upload is unreadable
    return files


def _quarantined_line(source: str, line_no: int, data: bytes, error: Exception) -> RawRecord:
    """The RawRecord of a line the fast parser rejected, with the most precise reason."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRecord(source, line_no, None, data, "invalid UTF-8", f"byte {exc.start}: {exc.reason}")
    message = str(error)
    for marker, reason in (("surrogate", "invalid Unicode"), ("depth limit", "nesting too deep"),
                           ("infinity when parsed", "number out of range")):
        if marker in message:
            return RawRecord(source, line_no, None, data, reason, message)
    # orjson follows RFC 8259; Python's parser also reads NaN / Infinity, so such a record gets
    # the validator's more useful reason ("non-finite number") instead of "malformed JSON".
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return RawRecord(source, line_no, None, data, "invalid Unicode",
                         f"{exc.reason}: {exc.object[exc.start:exc.end]!r}")
    except (ValueError, RecursionError):
        return RawRecord(source, line_no, None, data, "malformed JSON", message)
    return _parsed(source, line_no, data, value)


def _parsed(source: str, line_no: int, data: bytes, value: Any) -> RawRecord:
    if not isinstance(value, dict):
        return RawRecord(source, line_no, None, data, "wrong type",
                         f"a record must be a JSON object, got {type(value).__name__}")
    return RawRecord(source, line_no, value, data)


READ_BATCH_ROWS = 8192
"""Records parsed (JSON Lines) or decoded (Parquet) at a time, then validated together."""


@dataclass
class RecordBatch:
    """Up to READ_BATCH_ROWS consecutive records of one input file."""

    source: str
    lines: list[int]
    """1-based line (JSON Lines) or row (Parquet) number of each record in `source`."""
    values: list[Any] | None
    """Parsed records (JSON Lines; None where the line failed, see `failed`); None for Parquet,
    whose rows stay in `table` until a record is needed one by one."""
    raws: list[bytes] | None = None
    """The lines as read (JSON Lines only)."""
    failed: dict[int, RawRecord] = field(default_factory=dict)
    """Index -> the RawRecord (with its reason) of each line that did not parse to an object."""
    table: pa.RecordBatch | None = None

    def __len__(self) -> int:
        return len(self.lines)

    def rows(self, indices: Sequence[int]) -> list[Any]:
        """The parsed records at `indices` (Parquet rows become dicts here)."""
        if self.values is not None:
            return [self.values[i] for i in indices]
        return self.table.take(pa.array(indices, pa.int64())).to_pylist() if len(indices) else []

    def raw_record(self, i: int, value: Any = None) -> RawRecord:
        """Record `i` as a RawRecord (`value`: its parsed form when the caller already has it)."""
        if i in self.failed:
            return self.failed[i]
        if self.values is not None:
            return RawRecord(self.source, self.lines[i], self.values[i], self.raws[i])
        return RawRecord(self.source, self.lines[i], value if value is not None else self.rows([i])[0])


class JsonlBatches:
    """The records of a JSON Lines file, or of its byte range [start, end) (cut at line starts), in
    batches. Line numbers count from the range's first line; `lines` counts the lines read so far,
    blank ones included, so a caller can number a later range."""

    def __init__(self, path: Path, batch_rows: int = READ_BATCH_ROWS, start: int = 0, end: int | None = None):
        self.path, self.batch_rows, self.start, self.end = Path(path), batch_rows, start, end
        self.lines = 0

    def __iter__(self) -> Iterator[RecordBatch]:
        source, pos = str(self.path), self.start
        self.lines = 0
        end = self.path.stat().st_size if self.end is None else self.end
        if self.start == 0 and end == 0:
            log.warning("input file %s is empty (0 bytes): it adds no records", self.path)
        batch, line_no, bom = RecordBatch(source, [], [], []), 0, self.start == 0
        # Binary mode and a per-line parse: one bad byte quarantines one line, not the whole file.
        with open(self.path, "rb") as fh:
            fh.seek(pos)
            for data in fh:
                if pos >= end:
                    break
                pos += len(data)
                line_no += 1
                data = data.rstrip(b"\r\n")
                if bom:
                    bom, data = False, data.removeprefix(_BOM)
                try:
                    value = orjson.loads(data)  # validates UTF-8 and rejects lone surrogates itself
                except orjson.JSONDecodeError as exc:
                    if not data.strip():
                        continue  # blank lines separate nothing and hold no record
                    value = _quarantined_line(source, line_no, data, exc)
                if type(value) is not dict:
                    record = value if isinstance(value, RawRecord) else _parsed(source, line_no, data, value)
                    if record.reason:
                        batch.failed[len(batch.lines)] = record
                    value = record.value
                batch.lines.append(line_no)
                batch.values.append(value)
                batch.raws.append(data)
                if len(batch.lines) == self.batch_rows:
                    self.lines = line_no
                    yield batch
                    batch = RecordBatch(source, [], [], [])
        self.lines = line_no
        if batch.lines:
            yield batch


def open_parquet(path: Path) -> pq.ParquetFile:
    """The Parquet file at `path`; BadInputError naming it when its footer cannot be read."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise BadInputError(f"cannot read Parquet file {path}: {exc}; re-export or re-upload the shard "
                            f"(a truncated upload is the usual cause)") from None


def parquet_batches(path: Path, batch_rows: int = READ_BATCH_ROWS, row_groups: Sequence[int] | None = None,
                    first_row: int = 1) -> Iterator[RecordBatch]:
    """The rows of a Parquet file (or of its `row_groups`, the first of which is row `first_row`)."""
    source, row, parquet = str(path), first_row - 1, open_parquet(path)
    try:
        for table in parquet.iter_batches(batch_size=batch_rows, row_groups=row_groups):
            table.validate(full=True)  # invalid UTF-8 in a string column fails here, with the row range
            yield RecordBatch(source, list(range(row + 1, row + 1 + table.num_rows)), None, table=table)
            row += table.num_rows
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        # Parquet stores rows in compressed column chunks: a damaged chunk loses rows we cannot name.
        raise BadInputError(f"cannot read Parquet file {path} after row {row}: {exc}; re-export or re-upload "
                            f"the shard") from None


def iter_batches(files: Iterable[Path], batch_rows: int = READ_BATCH_ROWS) -> Iterator[RecordBatch]:
    """Every non-blank line / row of `files`, in order, in batches of at most `batch_rows` per file."""
    for path in files:
        if input_format(path) == "parquet":
            yield from parquet_batches(path, batch_rows)
        else:
            yield from JsonlBatches(path, batch_rows)


def iter_records(files: Iterable[Path]) -> Iterator[RawRecord]:
    """Every non-blank line / row of `files`, in order, parsed where possible."""
    for batch in iter_batches(files):
        values = batch.rows(range(len(batch)))
        for i, value in enumerate(values):
            yield batch.raw_record(i, value)
