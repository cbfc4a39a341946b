"""The prepared data on disk: the catalog and pair arrays, their Parquet files and memory-mapped
.npy columns, and loading RUN_DIR/prepared/ for the later steps (docs/data.md, "Outputs")."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline_contract import PREPARE_REPORT, PREPARED_DIR

from .config import DataConfig, from_dict
from .errors import BadInputError
from .feature_schema import Schema
from .fileio import atomic_path, read_json


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


LIST_VALUES = 2**31 - 1
"""Values one chunk of a list column holds at most: its offsets are int32 (a catalog of 17 million
products x 128 tokens holds more)."""


def _list_column(matrix: np.ndarray) -> pa.Array | pa.ChunkedArray:
    """A [n, w] array as a list<...> column without a Python loop (uniform offsets), in chunks of
    at most LIST_VALUES values."""
    n, width = matrix.shape
    values = pa.array(np.ascontiguousarray(matrix).reshape(-1))
    rows = LIST_VALUES // width if width else n  # width 0: a catalog without numeric features
    chunks = [pa.ListArray.from_arrays(pa.array(np.arange(min(rows, n - start) + 1, dtype=np.int32) * width),
                                       values.slice(start * width, min(rows, n - start) * width))
              for start in range(0, max(n, 1), max(rows, 1))]
    return chunks[0] if len(chunks) == 1 else pa.chunked_array(chunks)


def _matrix(table: pa.Table, name: str, width: int, dtype: Any, path: Path) -> np.ndarray:
    column = table.column(name)
    values = pc.list_flatten(column).to_numpy()  # chunk by chunk: their offsets may not fit one int32 column
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
    prepared = Path(run_dir) / PREPARED_DIR
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
