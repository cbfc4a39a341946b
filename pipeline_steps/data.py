"""The data layer: input records -> validated records -> tokenised arrays -> static-shape batches.

Reads JSON Lines (`*.jsonl`, `*.ndjson`) or Parquet, a file or a directory of shards (recursively,
sorted; paths with a part starting with "." or "_", such as `_SUCCESS`, are skipped). The record
schemas, the quarantine reasons and the prepared files are in docs/data.md.
`TrainBatches` (training: bucketed, static shapes, sharded per rank, seeded order) and
`text_batches` (inference: every row once, sorted by length) index pre-tokenised numpy arrays, so
a batch is a few vectorised gathers.

A library; the step is `python -m pipeline_steps prepare --run-dir DIR --demo`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .config import DataConfig, from_dict
from .contract import FSX_INCOMING, PREPARE_REPORT, PREPARED_DIR
from .errors import BadInputError
from .fileio import atomic_path, atomic_write_json, read_json

if TYPE_CHECKING:  # torch is imported lazily: `prepare` never needs it
    import torch

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID = 0
IGNORE_INDEX = -100
"""Class id of rows without a label (torch's cross_entropy default ignore_index)."""
INPUT_SUFFIXES = (".jsonl", ".ndjson", ".parquet")
_BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some editors write first
NUMERIC_CLIP = 10.0
"""Normalised numeric features are clipped to +-this many standard deviations, so one absurd
price cannot saturate the fusion MLP."""
PREPARED = PREPARED_DIR

log = logging.getLogger("pipeline_steps.data")


# ---------------------------------------------------------------------------------------------
# Reading records
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Validating records
# ---------------------------------------------------------------------------------------------

class RecordError(ValueError):
    """A record that fails validation: `reason` is a stable category (counted in prepare.json),
    `detail` says exactly what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)  # built once per record: slots make that ~2x cheaper than frozen
class ProductRecord:
    id: str
    title: str
    description: str | None = None
    numeric: dict[str, float] = field(default_factory=dict)
    categorical: dict[str, str] = field(default_factory=dict)
    category: str | None = None
    source: str = ""
    line: int = 0

    @property
    def text(self) -> str:
        """The product text the encoder and BM25 see: title, then description."""
        return self.title if not self.description else f"{self.title} {self.description}"


@dataclass(slots=True)  # built once per record: slots make that ~2x cheaper than frozen
class PairRecord:
    query: str
    product_id: str
    weight: float = 1.0
    label: str | None = None
    source: str = ""
    line: int = 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_float(value: Any, name: str) -> float:
    """`value` (a JSON/Parquet number) as a finite float, or RecordError saying why not."""
    if not _is_number(value):
        raise RecordError("wrong type", f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)  # Python ints are unbounded: 10**400 has no float
    except OverflowError:
        raise RecordError("number out of range", f"{name} does not fit a 64-bit float") from None
    if not math.isfinite(number):
        raise RecordError("non-finite number", f"{name} is {number}")
    return number


_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def collapse_spaces(text: str) -> str:
    """`" ".join(text.split())`: words separated by single spaces, none at either end. A long text
    that already is so (most descriptions) is returned as it is, found by scans that run in C
    instead of splitting it into words: ASCII without control characters has no whitespace but
    the space."""
    if len(text) > 64 and text.isascii() and not text.encode("ascii").translate(None, _PRINTABLE_ASCII) \
            and "  " not in text and text[0] != " " and text[-1] != " ":
        return text
    return " ".join(text.split())


def _text(record: dict, name: str, max_chars: int, *, required: bool) -> str | None:
    """A text field, whitespace-collapsed; None when optional and absent/empty."""
    value = record.get(name)
    if value is None:
        if required:
            raise RecordError("missing field", f"missing field {name!r}")
        return None
    if not isinstance(value, str):
        raise RecordError("wrong type", f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise RecordError("text too long", f"{name} has {len(value)} characters (max_text_chars is {max_chars})")
    value = collapse_spaces(value)
    if not value:
        if required:
            raise RecordError("empty text", f"{name} is empty")
        return None
    return value


def _identifier(record: dict, name: str, max_chars: int) -> str:
    # Ids are matched exactly (pairs -> products), so unlike text they are not normalised.
    value = record.get(name)
    if value is None:
        raise RecordError("missing field", f"missing field {name!r}")
    if not isinstance(value, str):
        raise RecordError("wrong type", f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty text", f"{name} is empty")
    if len(value) > max_chars:
        raise RecordError("text too long", f"{name} has {len(value)} characters (max_text_chars is {max_chars})")
    return value


def _mapping(record: dict, name: str) -> dict[str, Any]:
    value = record.get(name)
    if value is None:
        return {}
    if isinstance(value, list):  # a Parquet map column reads back as a list of (key, value) tuples
        if not all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
            raise RecordError("wrong type", f"{name} must be an object of name -> value")
        value = dict(value)
    if not isinstance(value, dict):
        raise RecordError("wrong type", f"{name} must be an object of name -> value, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str) or not key:
            raise RecordError("wrong type", f"{name} has a non-string or empty feature name {key!r}")
    return value


def _numeric_features(record: dict) -> dict[str, float]:
    features = {}
    # A None value (a Parquet struct without that field, or JSON null) is a missing feature.
    for key, value in _mapping(record, "numeric").items():
        if value is None:
            continue
        features[key] = _finite_float(value, f"numeric.{key}")
    return features


def _categorical_features(record: dict) -> dict[str, str]:
    features = {}
    for key, value in _mapping(record, "categorical").items():
        if value is None:
            continue
        # Integer codes are common in exported catalogs; they are category names, not quantities.
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        elif isinstance(value, float) and value.is_integer():
            value = str(int(value))
        if not isinstance(value, str):
            raise RecordError("wrong type", f"categorical.{key} must be a string, got {type(value).__name__}")
        if value.strip():
            features[key] = value.strip()
    return features


def validate_product(record: dict, max_chars: int, source: str = "", line: int = 0) -> ProductRecord:
    """A ProductRecord, or RecordError saying why the record is unusable."""
    return ProductRecord(
        id=_identifier(record, "id", max_chars),
        title=_text(record, "title", max_chars, required=True),
        description=_text(record, "description", max_chars, required=False),
        numeric=_numeric_features(record),
        categorical=_categorical_features(record),
        category=_text(record, "category", max_chars, required=False),
        source=source,
        line=line,
    )


def validate_pair(record: dict, max_chars: int, source: str = "", line: int = 0) -> PairRecord:
    """A PairRecord, or RecordError saying why the record is unusable."""
    # The common case in a few checks (pairs are the bulk of the input); anything else takes the
    # field-by-field path below, which gives the reason.
    query, product_id, weight = record.get("query"), record.get("product_id"), record.get("weight")
    if (type(query) is str and type(product_id) is str and record.get("label") is None
            and (weight is None or (type(weight) is float and 0.0 < weight < math.inf))
            and len(query) <= max_chars and len(product_id) <= max_chars and not product_id.isspace() and product_id):
        text = " ".join(query.split())
        if text:
            return PairRecord(text, product_id, 1.0 if weight is None else weight, None, source, line)
    weight = record.get("weight")
    if weight is None:
        weight = 1.0
    weight = _finite_float(weight, "weight")
    if weight <= 0:
        raise RecordError("non-positive weight", f"weight must be > 0, got {weight}")
    return PairRecord(
        query=_text(record, "query", max_chars, required=True),
        product_id=_identifier(record, "product_id", max_chars),
        weight=float(weight),
        label=_text(record, "label", max_chars, required=False),
        source=source,
        line=line,
    )


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _continuing_subword_tokens(tokenizer: Tokenizer, texts: Sequence[str], chunk: int = 1_000) -> list[str]:
    """"##c" for every character of the normalised `texts` that can occur inside a word, sorted:
    all but whitespace and punctuation, where the BERT pre-tokenizer splits (a character seen only
    at word starts adds an unused token, which is harmless). The normalizer maps characters one by
    one, so the characters of the normalised texts are those of their normalised distinct characters."""
    seen = np.zeros(0x110000, dtype=bool)
    for start in range(0, len(texts), chunk):  # code points found by numpy, not one Python str per character
        seen[np.frombuffer("".join(texts[start:start + chunk]).encode("utf-32-le"), dtype=np.uint32)] = True
    chars = set("".join(tokenizer.normalizer.normalize_str(chr(c)) for c in np.flatnonzero(seen).tolist()))
    inside = (c for c in chars if not c.isspace() and not unicodedata.category(c).startswith("P"))
    return ["##" + c for c in sorted(inside)]


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A BERT-style WordPiece tokenizer trained on `texts`: NFD + lowercase + strip accents,
    whitespace/punctuation pre-tokenisation, [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4, and every
    encoding wrapped as [CLS] ... [SEP] (queries and products alike). Deterministic for `texts`."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(),
                                                 normalizers.StripAccents()])
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # The trainer numbers the "##c" tokens in hash-map order and breaks ties between equally
    # frequent merges by those numbers, so the same text gives a different vocabulary on every run
    # (huggingface/tokenizers#1794). Declaring them up front, sorted, fixes their ids; they are
    # removed from the special (never-split) tokens afterwards and stay ordinary vocabulary.
    seeded = _continuing_subword_tokens(tokenizer, texts)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS) + seeded,
                                        show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), f"special token ids {ids}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids[2]), ("[SEP]", ids[3])])
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"tokenizer {path} not found; run `python -m pipeline_steps prepare` for this run dir")
    return Tokenizer.from_file(str(path))


ENCODE_CHUNK = 8192
"""Distinct texts encoded per call: the tokenizer's Encoding objects (ids, tokens, masks) cost
~100x the int32 row they become, so encoding a whole catalog at once peaks at gigabytes."""


def distinct_texts(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """(the distinct texts in order of first appearance, int64 [n]: each text's index in them),
    by Arrow's hash table instead of a Python dict."""
    array = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, pa.string())
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    encoded = pc.dictionary_encode(array)
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


ENCODE_CACHE_TEXTS = 1 << 18
"""Distinct texts a TextEncoder remembers (their rows: 32 MB at 32 tokens). Queries repeat
across the chunks of a click log: each is encoded once, not once per chunk."""


class TextEncoder:
    """`encode_texts` that remembers the rows of up to `capacity` texts across calls (the first
    ones seen; a text's row does not depend on the call, so the result is the same)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, capacity: int = ENCODE_CACHE_TEXTS):
        # A private copy: truncation is tokenizer state and the caller's object stays untouched.
        self._tok = Tokenizer.from_str(tokenizer.to_str())
        self._tok.enable_truncation(max_length=max_length)
        self._tok.no_padding()  # padding here is cheaper than turning 0s into Python ints and back
        self._words = WordEncoder.of(tokenizer, max_length)
        self.max_length, self.capacity = max_length, capacity
        self._row: dict[str, int] = {}
        self._ids = np.zeros((0, max_length), dtype=np.int32)
        self._lengths = np.zeros(0, dtype=np.int32)

    def __call__(self, texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids int32 [n, max_length], lengths int32 [n] = real tokens incl. specials)."""
        # Each distinct text is encoded once: queries repeat across the pairs of a click log.
        distinct, inverse = distinct_texts(texts)
        known = np.fromiter((self._row.get(t, -1) for t in distinct), dtype=np.int64, count=len(distinct))
        missing = np.flatnonzero(known < 0)
        new_ids, new_lengths = self._encode([distinct[i] for i in missing])
        ids = np.empty((len(distinct), self.max_length), dtype=np.int32)
        lengths = np.empty(len(distinct), dtype=np.int32)
        cached = np.flatnonzero(known >= 0)
        ids[cached], lengths[cached] = self._ids[known[cached]], self._lengths[known[cached]]
        ids[missing], lengths[missing] = new_ids, new_lengths
        self._remember([distinct[i] for i in missing], new_ids, new_lengths)
        return ids[inverse], lengths[inverse]

    def _remember(self, texts: list[str], ids: np.ndarray, lengths: np.ndarray) -> None:
        room = min(len(texts), self.capacity - len(self._row))
        if room <= 0:
            return
        start = len(self._row)
        self._row.update(zip(texts[:room], range(start, start + room)))
        self._ids = np.concatenate([self._ids, ids[:room]])
        self._lengths = np.concatenate([self._lengths, lengths[:room]])

    def _encode(self, distinct: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._words is not None:
            return self._words(distinct)
        return _encode_rows(self._tok, distinct, self.max_length)


def _encode_flat(tok: Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [total] of every text one after the other, lengths int32 [n]) of `texts` as `tok`
    encodes them (its truncation included), ENCODE_CHUNK texts per call."""
    flats, lengths = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int32)]
    for start in range(0, len(texts), ENCODE_CHUNK):
        encodings = tok.encode_batch_fast(texts[start:start + ENCODE_CHUNK])  # no character offsets
        id_lists = [e.ids for e in encodings]  # each .ids builds a new Python list: once per encoding
        lengths.append(np.fromiter(map(len, id_lists), dtype=np.int32, count=len(id_lists)))
        flats.append(np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths[-1].sum())))
    return np.concatenate(flats), np.concatenate(lengths)


def _encode_rows(tok: Tokenizer, texts: Sequence[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n, width] 0-padded, lengths int32 [n]) of `texts` as `tok` encodes them (its
    truncation included)."""
    flat, lengths = _encode_flat(tok, texts)
    ids = np.zeros((len(texts), width), dtype=np.int32)
    rows = np.repeat(np.arange(len(texts)), lengths)
    ids[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = flat
    return ids, lengths


ENCODE_WORDS = 4096
"""Distinct words encoded as one text by WordEncoder."""
WORD_CHUNK_BYTES = 1 << 22
"""Bytes of text split into words at a time (bounds the word arrays: ~100 bytes per word)."""
WORD_CACHE_WORDS = 1 << 19
"""Distinct words a WordEncoder remembers the tokens of (~150 bytes each): the words of a catalog
repeat across its chunks and calls, so each is tokenised once, not once per chunk."""
_SPACE_SAFE_NORMALIZERS = frozenset({"NFD", "Lowercase", "StripAccents", "BertNormalizer"})
"""Normalizers that map each character on its own (NFD reorders only combining marks, which a
space separates), so a space stays a space and nothing crosses it."""


class WordEncoder:
    """`encode_texts` by words: the tokens of a text are the tokens of its space-separated words
    in order, so each distinct word is tokenised once and the rows are assembled with numpy. Exact
    for the tokenizers `of` accepts: every stage treats a space as a boundary (normalizers that
    map characters one by one, the BERT pre-tokenizer that splits at whitespace, WordPiece per
    word, added tokens without spaces or stripping), and the post-processor wraps a text in one
    token before and one after ([CLS] ... [SEP]). The tokens of the first `capacity` distinct
    words are remembered across chunks and calls (a word's tokens do not depend on its text)."""

    def __init__(self, inner: Tokenizer, max_length: int, first: int, last: int, capacity: int = WORD_CACHE_WORDS):
        self._inner, self.max_length, self.first, self.last = inner, max_length, first, last
        self.capacity = capacity
        self._slot: dict[str, int] = {}  # word -> its index in _start / _count
        self._tokens = np.zeros(0, dtype=np.int32)  # the remembered words' tokens, one after the other
        self._start = np.zeros(0, dtype=np.int64)
        self._count = np.zeros(0, dtype=np.int64)

    @classmethod
    def of(cls, tokenizer: Tokenizer, max_length: int) -> WordEncoder | None:
        """The word encoder of `tokenizer`, None when its output could differ from encoding whole texts."""
        spec = json.loads(tokenizer.to_str())
        normalizer = spec.get("normalizer") or {"type": "Sequence", "normalizers": []}
        steps = normalizer.get("normalizers", []) if normalizer["type"] == "Sequence" else [normalizer]
        post = spec.get("post_processor") or {}
        single = post.get("single", [])
        if (max_length <= 2 or any(step.get("type") not in _SPACE_SAFE_NORMALIZERS for step in steps)
                or (spec.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
                or spec["model"].get("type") != "WordPiece"
                or any(t["lstrip"] or t["rstrip"] or t["single_word"] or any(c.isspace() for c in t["content"])
                       for t in spec.get("added_tokens", []))
                or post.get("type") != "TemplateProcessing"
                or [next(iter(part)) for part in single] != ["SpecialToken", "Sequence", "SpecialToken"]):
            return None
        first, last = (post["special_tokens"][single[k]["SpecialToken"]["id"]]["ids"] for k in (0, 2))
        if len(first) != 1 or len(last) != 1:
            return None
        # The words' own tokens, without [CLS]/[SEP].
        spec.update(post_processor=None, truncation=None, padding=None)
        return cls(Tokenizer.from_str(json.dumps(spec)), max_length, first[0], last[0])

    def __call__(self, texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids int32 [n, max_length], lengths int32 [n]), as encode_texts."""
        array = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, pa.string())
        ids = np.zeros((len(array), self.max_length), dtype=np.int32)
        lengths = np.zeros(len(array), dtype=np.int32)
        ends = np.cumsum(pc.binary_length(array).to_numpy(zero_copy_only=False).astype(np.int64) + 1)
        start = 0
        while start < len(array):
            # At least one text per chunk; then as many as fit in WORD_CHUNK_BYTES.
            before = ends[start - 1] if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, before + WORD_CHUNK_BYTES, side="right")))
            chunk = array.slice(start, stop - start)
            self._fill(chunk.combine_chunks() if isinstance(chunk, pa.ChunkedArray) else chunk,
                       ids[start:stop], lengths[start:stop])
            start = stop
        return ids, lengths

    def _words(self, distinct: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, start, count): the tokens of `distinct`[k] are tokens[start[k]:start[k] + count[k]].
        Remembered words are looked up; the others are tokenised, and remembered while there is room."""
        slot = np.fromiter((self._slot.get(w, -1) for w in distinct), dtype=np.int64, count=len(distinct))
        new = np.flatnonzero(slot < 0)
        tokens, start, count = self._tokens, self._start, self._count
        if len(new):
            words = [distinct[i] for i in new]
            flat, lengths = self._encode_words(words)
            slot[new] = len(start) + np.arange(len(new))
            start = np.concatenate([start, len(tokens) + np.cumsum(lengths, dtype=np.int64) - lengths])
            count = np.concatenate([count, lengths.astype(np.int64)])
            tokens = np.concatenate([tokens, flat])
            keep = len(self._start) + min(len(new), self.capacity - len(self._slot))
            if keep > len(self._start):
                self._slot.update(zip(words, range(len(self._start), keep)))
                self._start, self._count = start[:keep], count[:keep]
                self._tokens = tokens[:int(start[keep - 1] + count[keep - 1])]
        return tokens, start[slot], count[slot]

    def _encode_words(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 of every word's tokens one after the other, count int32 [n]), each word cut at
        the room a text leaves for its tokens. ENCODE_WORDS words are joined by spaces into one text
        per encoding (one Encoding per word costs more than its tokens); the words of a token are
        found from its character offset, inside its word's span of the joined text."""
        room = self.max_length - 2
        batches = [words[i:i + ENCODE_WORDS] for i in range(0, len(words), ENCODE_WORDS)]
        flats, counts = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int32)]
        for batch, encoding in zip(batches, self._inner.encode_batch([" ".join(b) for b in batches],
                                                                     add_special_tokens=False)):
            ids = np.array(encoding.ids, dtype=np.int32)
            spans = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch)) + 1
            offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            word = np.searchsorted(np.cumsum(spans) - spans, offsets, side="right") - 1
            count = np.bincount(word, minlength=len(batch))
            within = np.arange(len(word)) - (np.cumsum(count) - count)[word]
            flats.append(ids[within < room])
            counts.append(np.minimum(count, room).astype(np.int32))
        return np.concatenate(flats), np.concatenate(counts)

    def _fill(self, texts: pa.Array, ids: np.ndarray, lengths: np.ndarray, whole: bool = False) -> None:
        room = self.max_length - 2
        # A word has at least one token (but for rare words, such as a lone accent the normalizer
        # drops), so a text's first `room` words fill its row: a long description is split no further.
        # A text with more words whose first `room` do not fill it is encoded again `whole`, below.
        words = pc.split_pattern(texts, " ", max_splits=None if whole else room)  # "" -> [""]: a word per text
        per_text = pc.list_value_length(words).to_numpy(zero_copy_only=False).astype(np.int64)
        more = (per_text > room) & (not whole)
        if more.any():
            words, per_text = pc.list_slice(words, 0, room), np.minimum(per_text, room)
        distinct, word = distinct_texts(pc.list_flatten(words))
        tokens, word_start, word_count = self._words(distinct)
        # One entry per word occurrence: where its first token lands in its text.
        occurrence_tokens = word_count[word]
        text_of = np.repeat(np.arange(len(texts)), per_text)
        ends = np.cumsum(occurrence_tokens)
        starts = ends - occurrence_tokens
        first_occurrence = np.cumsum(per_text) - per_text
        text_start = starts[first_occurrence]
        position = starts - text_start[text_of]
        tokens_per_text = ends[first_occurrence + per_text - 1] - text_start
        lengths[:] = np.minimum(tokens_per_text, room) + 2
        # Then one entry per token that fits: truncation drops the rest before it costs anything.
        inside = np.flatnonzero(position < room)
        fits = np.minimum(occurrence_tokens[inside], room - position[inside])
        token_of = np.repeat(inside, fits)
        within = np.arange(len(token_of)) - np.repeat(np.cumsum(fits) - fits, fits)
        ids[text_of[token_of], position[token_of] + within + 1] = tokens[word_start[word[token_of]] + within]
        ids[:, 0] = self.first
        ids[np.arange(len(texts)), lengths - 1] = self.last
        short = np.flatnonzero(more & (tokens_per_text < room))
        if len(short):
            again_ids, again_lengths = np.zeros((len(short), self.max_length), dtype=np.int32), np.zeros_like(short)
            self._fill(texts.take(pa.array(short)), again_ids, again_lengths, whole=True)
            ids[short], lengths[short] = again_ids, again_lengths


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str] | pa.Array | pa.ChunkedArray,
                 max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode `texts` as [CLS] ... [SEP], truncated (keeping [SEP]) and padded with 0 to `max_length`.
    Returns (token_ids int32 [n, max_length], lengths int32 [n] = real tokens incl. specials).
    By words when the tokenizer allows (no pass over the distinct texts: a catalog's texts hardly
    repeat, and that pass would hold a second copy of them)."""
    words = WordEncoder.of(tokenizer, max_length)
    return words(texts) if words is not None else TextEncoder(tokenizer, max_length, capacity=0)(texts)


def normalise_query(text: str) -> str:
    """The form two queries must share to count as the same query: NFKD, accents dropped,
    lowercase, single spaces."""
    if text.isascii():  # nothing to decompose or drop: the common case, 5x faster
        return " ".join(text.lower().split())
    stripped = unicodedata.normalize("NFKD", text).translate(_COMBINING_MARKS)
    return " ".join(stripped.lower().split())


class _CombiningMarks(dict):
    """A str.translate table that drops combining marks (accents), filled one code point at a time
    as texts meet them: a translate runs in C, a per-character Python loop took most of the time of
    the holdout split of non-ASCII queries."""

    def __missing__(self, code: int) -> int | None:
        self[code] = None if unicodedata.combining(chr(code)) else code
        return self[code]


_COMBINING_MARKS = _CombiningMarks()


def query_keys(queries: Sequence[str], seed: int, cache: dict[str, int] | None = None) -> np.ndarray:
    """uint64 [n]: a hash of (seed, normalised query): equal for the same query, whatever its case,
    accents or spacing. It decides the holdout split and counts distinct queries. `cache`: the keys
    of queries seen in earlier calls with the same seed (filled here, and emptied once it holds
    ENCODE_CACHE_TEXTS queries, so its memory stays bounded), when the caller keeps one."""
    distinct, inverse = distinct_texts(queries)  # a query repeats across many pairs (clicks, purchases)
    cache = {} if cache is None else cache
    if len(cache) > ENCODE_CACHE_TEXTS:
        cache.clear()
    prefix = f"{seed}\x00"

    def key(query: str) -> int:
        found = cache.get(query)
        if found is None:
            digest = hashlib.blake2b((prefix + normalise_query(query)).encode("utf-8"), digest_size=8).digest()
            found = cache[query] = int.from_bytes(digest, "big")
        return found

    return np.fromiter(map(key, distinct), dtype=np.uint64, count=len(distinct))[inverse]


def holdout_threshold(fraction: float) -> np.uint64:
    return np.uint64(int(fraction * 2**64))


def holdout_mask(queries: Sequence[str], fraction: float, seed: int) -> np.ndarray:
    """bool [n]: True for pairs whose query is held out. Decided by a hash of (seed, normalised
    query), so every pair of one query lands on the same side, and a query keeps its side in the
    next data version (incremental runs are validated on queries they never trained on)."""
    return query_keys(queries, seed) < holdout_threshold(fraction)


class TextSample:
    """At most `size` distinct texts: those with the smallest hashes, and of those the first that fit
    in `max_chars` characters. The same sample whatever the order the texts arrive in or how the
    input is sharded, in bounded memory."""

    def __init__(self, size: int, max_chars: int | None = None):
        self.size, self.max_chars = size, max_chars
        self._hashes = np.zeros(0, dtype=np.uint64)  # of the kept texts, in the order of _texts
        self._texts = np.empty(0, dtype=object)
        self._kept: set[str] = set()

    def update(self, texts: Iterable[str]) -> None:
        new = list(set(texts) - self._kept)
        hashes = text_hashes(new)
        if len(self._hashes) >= self.size:  # only a hash below the largest kept one can enter
            below = np.flatnonzero(hashes < self._hashes.max())
            new, hashes = [new[i] for i in below], hashes[below]
        if not new:
            return
        # The `size` smallest of the kept and the new hashes, found by numpy; the kept texts stay
        # in arrays, so an update costs the new texts, not a rebuild of the whole sample in Python.
        every = np.concatenate([self._hashes, hashes])
        texts = np.concatenate([self._texts, np.array(new, dtype=object)])
        if len(every) > self.size:
            keep = np.argpartition(every, self.size - 1)[:self.size]
            every, texts = every[keep], texts[keep]
            self._kept = set(texts.tolist())
        else:
            self._kept.update(new)
        self._hashes, self._texts = every, texts

    def texts(self) -> list[str]:
        """The sample, in hash order (deterministic), cut at `max_chars` characters."""
        ordered = [text for _, text in sorted(zip([-h for h in self._hashes.tolist()], self._texts.tolist()),
                                              reverse=True)]
        if self.max_chars is not None:
            fit = np.cumsum(np.fromiter(map(len, ordered), dtype=np.int64, count=len(ordered))) <= self.max_chars
            ordered = ordered[:int(fit.sum())]
        return ordered


def text_hashes(texts: Sequence[str]) -> np.ndarray:
    """uint64 [n]: the first 8 bytes of each text's blake2b digest, big-endian."""
    digests = b"".join([hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest() for text in texts])
    return np.frombuffer(digests, dtype=">u8").astype(np.uint64)


# ---------------------------------------------------------------------------------------------
# Schema: explicit features and classes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Schema:
    """Names, normalisation and vocabularies of the explicit features, fixed at the first prepare
    and reused unchanged by incremental runs (`--init-from`) so a model keeps its input layout."""

    numeric_names: tuple[str, ...] = ()
    numeric_mean: tuple[float, ...] = ()
    numeric_std: tuple[float, ...] = ()
    categorical_names: tuple[str, ...] = ()
    categorical_vocabs: tuple[tuple[str, ...], ...] = ()
    """Values of each categorical feature; id = index + 1, 0 = unknown/missing."""
    class_names: tuple[str, ...] = ()
    """Classes of the auxiliary head; empty = no head."""

    def __post_init__(self) -> None:
        if not len(self.numeric_names) == len(self.numeric_mean) == len(self.numeric_std):
            raise BadInputError("schema: numeric_names, numeric_mean and numeric_std differ in length")
        if len(self.categorical_names) != len(self.categorical_vocabs):
            raise BadInputError("schema: categorical_names and categorical_vocabs differ in length")

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(len(v) + 1 for v in self.categorical_vocabs)

    @classmethod
    def fit(cls, products: Sequence[ProductRecord], pair_labels: Iterable[str | None] = ()) -> Schema:
        """Learn the schema from validated products (and pair labels, which add classes)."""
        numeric_names = sorted({k for p in products for k in p.numeric})
        means, stds = [], []
        for name in numeric_names:
            values = np.array([p.numeric[name] for p in products if name in p.numeric], dtype=np.float64)
            std = float(values.std())
            means.append(float(values.mean()))
            stds.append(std if std > 1e-6 else 1.0)  # a constant feature: avoid dividing by zero
        categorical_names = sorted({k for p in products for k in p.categorical})
        vocabs = tuple(tuple(sorted({p.categorical[n] for p in products if n in p.categorical}))
                       for n in categorical_names)
        classes = {p.category for p in products if p.category} | {lbl for lbl in pair_labels if lbl}
        return cls(tuple(numeric_names), tuple(means), tuple(stds), tuple(categorical_names), vocabs,
                   tuple(sorted(classes)))

    def numeric_matrix(self, products: Sequence[ProductRecord]) -> np.ndarray:
        """float32 [N, F]: z-scored and clipped; a missing feature is the mean (0)."""
        out = np.zeros((len(products), len(self.numeric_names)), dtype=np.float32)
        for j, (name, mean, std) in enumerate(zip(self.numeric_names, self.numeric_mean, self.numeric_std)):
            col = np.array([p.numeric.get(name, mean) for p in products], dtype=np.float64)
            out[:, j] = np.clip((col - mean) / std, -NUMERIC_CLIP, NUMERIC_CLIP)
        return out

    def categorical_matrix(self, products: Sequence[ProductRecord]) -> np.ndarray:
        """int64 [N, C]: vocabulary ids; 0 for a missing or unseen value."""
        out = np.zeros((len(products), len(self.categorical_names)), dtype=np.int64)
        for j, (name, vocab) in enumerate(zip(self.categorical_names, self.categorical_vocabs)):
            index = {v: i + 1 for i, v in enumerate(vocab)}
            out[:, j] = [index.get(p.categorical.get(name, ""), 0) for p in products]
        return out

    def class_ids(self, labels: Sequence[str | None]) -> np.ndarray:
        """int64 [n]: class index, IGNORE_INDEX for no label or a class the schema does not know."""
        index = {c: i for i, c in enumerate(self.class_names)}
        return np.array([index.get(lbl, IGNORE_INDEX) if lbl else IGNORE_INDEX for lbl in labels], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"numeric_names": list(self.numeric_names), "numeric_mean": list(self.numeric_mean),
                "numeric_std": list(self.numeric_std), "categorical_names": list(self.categorical_names),
                "categorical_vocabs": [list(v) for v in self.categorical_vocabs],
                "class_names": list(self.class_names)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Schema:
        try:
            return cls(numeric_names=tuple(values["numeric_names"]),
                       numeric_mean=tuple(float(x) for x in values["numeric_mean"]),
                       numeric_std=tuple(float(x) for x in values["numeric_std"]),
                       categorical_names=tuple(values["categorical_names"]),
                       categorical_vocabs=tuple(tuple(v) for v in values["categorical_vocabs"]),
                       class_names=tuple(values["class_names"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInputError(f"invalid schema ({exc!r}); rerun prepare to rebuild it") from None

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        if not Path(path).is_file():
            raise BadInputError(f"schema {path} not found; run `python -m pipeline_steps prepare` for this run dir")
        return cls.from_dict(read_json(path))


# ---------------------------------------------------------------------------------------------
# Prepared arrays and their Parquet files
# ---------------------------------------------------------------------------------------------

@dataclass
class Products:
    ids: list[str]
    titles: list[str]
    texts: Sequence[str] | pa.ChunkedArray
    """title + " " + description: what BM25 indexes and the encoder reads (`prepare` holds them in
    one Arrow column)."""
    token_ids: np.ndarray  # int32 [N, max_bucket], 0-padded
    lengths: np.ndarray  # int32 [N]
    numeric: np.ndarray  # float32 [N, F], normalised
    categorical: np.ndarray  # int64 [N, C], 0 = unknown
    class_id: np.ndarray  # int64 [N], IGNORE_INDEX = none

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Pairs:
    queries: list[str]
    token_ids: np.ndarray  # int32 [M, query_length], 0-padded
    lengths: np.ndarray  # int32 [M]
    product_index: np.ndarray  # int64 [M], row in Products
    weight: np.ndarray  # float32 [M]
    class_id: np.ndarray  # int64 [M], IGNORE_INDEX = none

    def __len__(self) -> int:
        return len(self.product_index)


PAIR_ARRAYS = ("token_ids", "lengths", "product_index", "weight", "class_id")
"""The pair columns training reads; `prepare` also stores each as RUN_DIR/prepared/<side>_pairs.<name>.npy,
which every rank memory-maps: the ranks of a node share one copy in the page cache instead of
each holding its own."""


def pair_array_path(prepared: Path, side: str, name: str) -> Path:
    return prepared / f"{side}_pairs.{name}.npy"


PRODUCT_ARRAYS = {"token_ids": np.int32, "lengths": np.int32, "numeric": np.float32, "categorical": np.int64,
                  "class_id": np.int64}
"""The catalog columns training reads (with their stored dtypes); `save_products` also stores each
as RUN_DIR/prepared/products.<name>.npy, memory-mapped by every rank like the pair columns."""


def product_array_path(prepared: Path, name: str) -> Path:
    return prepared / f"products.{name}.npy"


class ParquetStrings(Sequence[str]):
    """A string column of a Parquet file, read on first use: training never reads the query or
    product texts, so its ranks never hold them."""

    def __init__(self, path: Path, column: str):
        self._path, self._column = path, column
        self._values: list[str] | None = None

    def _load(self) -> list[str]:
        if self._values is None:
            self._values = pq.read_table(self._path, columns=[self._column]).column(self._column).to_pylist()
        return self._values

    def __len__(self) -> int:
        return pq.ParquetFile(self._path).metadata.num_rows if self._values is None else len(self._values)

    def __getitem__(self, index):
        return self._load()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # mutable-looking sequence semantics, like list


@dataclass
class PreparedData:
    products: Products
    train: Pairs
    holdout: Pairs
    schema: Schema
    tokenizer_path: Path
    data_cfg: DataConfig


def _list_column(matrix: np.ndarray) -> pa.Array:
    """A [n, w] array as a list<...> column without a Python loop (uniform offsets)."""
    n, width = matrix.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)  # width 0: a catalog without numeric features
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(matrix).reshape(-1)))


def _matrix(table: pa.Table, name: str, width: int, dtype: Any, path: Path) -> np.ndarray:
    column = table.column(name).combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False)
    if values.size != len(column) * width:
        raise BadInputError(f"{path}: column {name} is not [{len(column)}, {width}]; the file does not "
                            f"match its prepare.json; rerun prepare")
    return values.astype(dtype, copy=False).reshape(len(column), width)


PRODUCTS_ROW_GROUP = 16_384
"""Rows per row group of products.parquet: the Parquet writer holds a row group's encoded columns
until it is written, so one row group of a catalog of long descriptions added 200+ MB to the peak."""


def save_products(path: str | Path, products: Products, arrays: bool = True) -> None:
    """products.parquet and (with `arrays`) the products.<column>.npy training memory-maps, beside it."""
    texts = products.texts
    table = pa.table({
        "id": pa.array(products.ids, pa.string()),
        "title": pa.array(products.titles, pa.string()),
        "text": texts if isinstance(texts, pa.ChunkedArray) else pa.array(texts, pa.string()),
        "token_ids": _list_column(products.token_ids.astype(np.int32, copy=False)),
        "length": pa.array(products.lengths.astype(np.int32, copy=False)),
        "numeric": _list_column(products.numeric.astype(np.float32, copy=False)),
        "categorical": _list_column(products.categorical.astype(np.int64, copy=False)),
        "class_id": pa.array(products.class_id.astype(np.int64, copy=False)),
    })
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, row_group_size=PRODUCTS_ROW_GROUP)
    for name, dtype in (PRODUCT_ARRAYS if arrays else {}).items():
        with atomic_path(product_array_path(Path(path).parent, name)) as tmp, open(tmp, "wb") as fh:
            np.save(fh, getattr(products, name).astype(dtype, copy=False))


PAIRS_SCHEMA = pa.schema([("query", pa.string()), ("product_id", pa.string()), ("product_index", pa.int64()),
                          ("token_ids", pa.list_(pa.int32())), ("length", pa.int32()), ("weight", pa.float32()),
                          ("class_id", pa.int64())])


def pairs_table(queries: pa.Array | Sequence[str], product_ids: pa.Array, pairs: Pairs) -> pa.Table:
    """The Parquet layout of pairs (`queries` and `product_ids` as Arrow arrays or lists; the
    other columns from `pairs`)."""
    return pa.table({
        "query": pa.array(queries, pa.string()),
        "product_id": pa.array(product_ids, pa.string()),
        "product_index": pa.array(pairs.product_index.astype(np.int64, copy=False)),
        "token_ids": _list_column(pairs.token_ids.astype(np.int32, copy=False)),
        "length": pa.array(pairs.lengths.astype(np.int32, copy=False)),
        "weight": pa.array(pairs.weight.astype(np.float32, copy=False)),
        "class_id": pa.array(pairs.class_id.astype(np.int64, copy=False)),
    }, schema=PAIRS_SCHEMA)


def save_pairs(path: str | Path, pairs: Pairs, product_ids: Sequence[str]) -> None:
    table = pairs_table(pairs.queries, pa.array(product_ids, pa.string()).take(pairs.product_index), pairs)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _read_table(path: Path) -> pa.Table:
    if not path.is_file():
        raise BadInputError(f"{path} is missing; rerun `python -m pipeline_steps prepare` for this run dir")
    return pq.read_table(path)


def read_products(path: str | Path, data_cfg: DataConfig, schema: Schema) -> Products:
    path = Path(path)
    t = _read_table(path)
    return Products(
        ids=t.column("id").to_pylist(), titles=t.column("title").to_pylist(), texts=t.column("text").to_pylist(),
        token_ids=_matrix(t, "token_ids", max(data_cfg.length_buckets), np.int32, path),
        lengths=t.column("length").to_numpy().astype(np.int32),
        numeric=_matrix(t, "numeric", len(schema.numeric_names), np.float32, path),
        categorical=_matrix(t, "categorical", len(schema.categorical_names), np.int64, path),
        class_id=t.column("class_id").to_numpy().astype(np.int64),
    )


def read_pairs(path: str | Path, data_cfg: DataConfig) -> Pairs:
    path = Path(path)
    t = _read_table(path)
    return Pairs(
        queries=t.column("query").to_pylist(),
        token_ids=_matrix(t, "token_ids", data_cfg.query_length, np.int32, path),
        lengths=t.column("length").to_numpy().astype(np.int32),
        product_index=t.column("product_index").to_numpy().astype(np.int64),
        weight=t.column("weight").to_numpy().astype(np.float32),
        class_id=t.column("class_id").to_numpy().astype(np.int64),
    )


def _load_pairs(prepared: Path, side: str, data_cfg: DataConfig) -> Pairs:
    """The pairs of one side: memory-mapped .npy arrays when prepare wrote them, else from Parquet."""
    parquet = prepared / f"{side}_pairs.parquet"
    paths = {name: pair_array_path(prepared, side, name) for name in PAIR_ARRAYS}
    if not all(path.is_file() for path in paths.values()):
        return read_pairs(parquet, data_cfg)
    arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    rows = {a.shape[0] for a in arrays.values()}
    if len(rows) != 1 or arrays["token_ids"].shape[1:] != (data_cfg.query_length,):
        raise BadInputError(f"the {side} pair arrays in {prepared} do not match each other or the data config; "
                            f"rerun prepare")
    return Pairs(queries=ParquetStrings(parquet, "query"), **arrays)


def _load_products(prepared: Path, data_cfg: DataConfig, schema: Schema) -> Products:
    """The catalog: its arrays memory-mapped from the .npy files when prepare wrote them (the ranks
    of a node share one copy in the page cache), its strings read from Parquet on first use."""
    parquet = prepared / "products.parquet"
    paths = {name: product_array_path(prepared, name) for name in PRODUCT_ARRAYS}
    if not all(path.is_file() for path in paths.values()):
        return read_products(parquet, data_cfg, schema)
    arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    widths = {"token_ids": max(data_cfg.length_buckets), "numeric": len(schema.numeric_names),
              "categorical": len(schema.categorical_names)}
    if len({a.shape[0] for a in arrays.values()}) != 1 or any(
            arrays[name].shape[1:] != (width,) for name, width in widths.items()):
        raise BadInputError(f"the product arrays in {prepared} do not match each other, the schema or the data "
                            f"config; rerun prepare")
    return Products(ids=ParquetStrings(parquet, "id"), titles=ParquetStrings(parquet, "title"),
                    texts=ParquetStrings(parquet, "text"), **arrays)


def load_prepared(run_dir: str | Path) -> PreparedData:
    """Everything `prepare` wrote for `run_dir`; BadInputError with the command to run if it hasn't."""
    prepared = Path(run_dir) / PREPARED
    report_path = Path(run_dir) / PREPARE_REPORT
    if not report_path.is_file():
        raise BadInputError(f"{run_dir} has no prepared data ({report_path} missing); run "
                            f"`python -m pipeline_steps prepare --run-dir {run_dir} --demo` (or --data DIR) first")
    report = read_json(report_path)
    if report.get("status") != "ok":
        why = report.get("error") or f"status {report.get('status')!r}"
        raise BadInputError(f"the last prepare of {run_dir} did not succeed ({why}); "
                            f"fix the input (see {prepared / 'quarantine.jsonl'}) and rerun prepare")
    data_cfg = from_dict(DataConfig, report["data_config"])
    schema = Schema.load(prepared / "schema.json")
    return PreparedData(
        products=_load_products(prepared, data_cfg, schema),
        train=_load_pairs(prepared, "train", data_cfg),
        holdout=_load_pairs(prepared, "holdout", data_cfg),
        schema=schema,
        tokenizer_path=prepared / "tokenizer.json",
        data_cfg=data_cfg,
    )


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------

def bucket_index(lengths: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """int64 [n]: index of the smallest bucket >= each length (the largest when none is)."""
    return np.minimum(np.searchsorted(np.asarray(buckets), lengths, side="left"), len(buckets) - 1).astype(np.int64)


def _pad_rows(rows: np.ndarray, batch_size: int) -> np.ndarray:
    """Row indices padded with -1 to a multiple of batch_size, as [num_batches, batch_size]."""
    padded = np.full(-(-len(rows) // batch_size) * batch_size, -1, dtype=np.int64)
    padded[:len(rows)] = rows
    return padded.reshape(-1, batch_size)


def _gather(token_ids: np.ndarray, lengths: np.ndarray, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """ids, mask int64 [B, width] for `rows` (-1 = padding row: all 0). No per-token Python loop."""
    real = rows >= 0
    safe = np.where(real, rows, 0)
    lens = np.where(real, np.minimum(lengths[safe], width), 0)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    cols = min(width, token_ids.shape[1])
    ids[:, :cols] = token_ids[safe, :cols]
    mask = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
    return ids * mask, mask


class TrainBatches:
    """Static-shape training batches of the train pairs, sharded per rank, seeded per epoch.

    Each pair goes to the smallest length bucket that holds its product's text. Within a bucket
    pairs are shuffled and cut into global steps of world_size batches of exactly `batch_size`
    rows, one per rank (the last step padded with masked rows, never dropped: fully-masked
    batches if need be); the steps of all buckets are then shuffled together. So in every step
    all ranks run the same bucket's graph (none waits for a longer bucket), and every rank steps
    the same number of times (a rank that stops early hangs the collective of the others). The
    order is a function of (seed, epoch): a resumed run continues it.
    """

    def __init__(self, data: PreparedData, batch_size: int, *, rank: int, world_size: int, seed: int):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size {batch_size} / rank {rank} / world_size {world_size}")
        self.data = data
        self.batch_size = batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.buckets = tuple(data.data_cfg.length_buckets)
        doc_lengths = data.products.lengths[data.train.product_index]
        which = bucket_index(doc_lengths, self.buckets)
        self._members = [np.flatnonzero(which == b) for b in range(len(self.buckets))]
        # No pairs at all (an empty holdout) means zero batches, not an error.
        self._steps = sum(-(-len(m) // (batch_size * world_size)) for m in self._members)

    def num_batches(self) -> int:
        """Batches per rank per epoch; identical on every rank and in every epoch."""
        return self._steps

    def _schedule(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """This rank's (bucket, row indices [B]) for `epoch`; the same on every call."""
        rng = np.random.default_rng([self.seed, epoch])
        steps: list[tuple[int, np.ndarray]] = []  # (bucket, row indices [world_size, B])
        for b, members in enumerate(self._members):
            for rows in _pad_rows(rng.permutation(members), self.batch_size * self.world_size):
                steps.append((b, rows.reshape(self.world_size, self.batch_size)))
        return [(steps[i][0], steps[i][1][self.rank]) for i in rng.permutation(len(steps))]

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """The batches of `epoch` for this rank, skipping the first `start` (resume mid-epoch)."""
        for bucket, rows in self._schedule(epoch)[start:]:
            yield self._batch(bucket, rows)

    def first_batch_per_bucket(self) -> list[dict[str, torch.Tensor]]:
        """One real batch per bucket that has pairs: every shape training will use (compile trial)."""
        return [self._batch(b, _pad_rows(m[:self.batch_size], self.batch_size)[0])
                for b, m in enumerate(self._members) if len(m)]

    def _batch(self, bucket: int, rows: np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        train, products = self.data.train, self.data.products
        real = rows >= 0
        safe = np.where(real, rows, 0)
        product = np.where(real, train.product_index[safe], -1)
        product_safe = np.maximum(product, 0)
        query_ids, query_mask = _gather(train.token_ids, train.lengths, rows, train.token_ids.shape[1])
        doc_ids, doc_mask = _gather(products.token_ids, products.lengths, product, self.buckets[bucket])
        arrays = {
            "query_ids": query_ids, "query_mask": query_mask, "doc_ids": doc_ids, "doc_mask": doc_mask,
            "numeric": products.numeric[product_safe] * real[:, None].astype(np.float32),
            "categorical": products.categorical[product_safe] * real[:, None],
            "row_mask": real.astype(np.float32),
            "weight": np.where(real, train.weight[safe], 0.0).astype(np.float32),
            "class_id": np.where(real, train.class_id[safe], IGNORE_INDEX).astype(np.int64),
            "product_index": product.astype(np.int64),
        }
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def text_batches(token_ids: np.ndarray, lengths: np.ndarray, batch_size: int,
                 buckets: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """Inference batches (validate, embed): (indices int64 [B], ids int64 [B, L], mask int64 [B, L],
    n_real). Rows are sorted by length and cut per bucket into exactly `batch_size` rows; the last
    batch of a bucket is padded with masked rows whose index is -1. Every input index appears once."""
    buckets = tuple(sorted(buckets))
    order = np.argsort(lengths, kind="stable")
    which = bucket_index(lengths[order], buckets)
    for b, width in enumerate(buckets):
        members = order[which == b]
        for rows in _pad_rows(members, batch_size):
            ids, mask = _gather(token_ids, lengths, rows, width)
            yield rows, ids, mask, int((rows >= 0).sum())
