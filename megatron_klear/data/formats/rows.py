"""Rows of a published data file, JSONL or parquet, each with its 1-based row number.

Parquet needs pyarrow, the ``[data]`` extra (``pip install -e '.[data]'`` in the repository's root),
imported only when a parquet file is read. A row that cannot be read is a :class:`RowError` naming
the column; the reader that calls these turns it into a
:class:`~megatron_klear.data.jsonl.BadLineError` with the file and row.
"""

from __future__ import annotations

import os
from typing import Iterator

from megatron_klear.data.jsonl import ExampleError, HashingLineReader, parse_json_object


class RowError(ExampleError):
    """One row's problem: ``column`` is the column (dotted for nested fields) it is about."""

    def __init__(self, reason: str, column: str | None, detail: str):
        super().__init__(reason, f"column {column}: {detail}" if column else detail)
        self.column = column

    def __reduce__(self):
        return (ExampleError, (self.reason, self.detail))


def require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "reading parquet needs pyarrow, from the [data] extra: pip install -e '.[data]' in the repository's "
            "root (or convert the file to JSONL)"
        ) from None
    return pq


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


def columns(path: str) -> list:
    """The column names (parquet: the schema's; JSONL: the first object's keys)."""
    if is_parquet(path):
        return list(require_pyarrow().ParquetFile(path).schema_arrow.names)
    for _, obj in iter_rows(path):
        if isinstance(obj, dict):
            return list(obj)
    return []


def iter_rows(path: str, batch_size: int = 256) -> Iterator[tuple[int, object]]:
    """``(row, dict)`` for each row; a JSONL line that is not a JSON object yields an
    :class:`ExampleError` in place of the dict (the caller names the row)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path!r} does not exist")
    if is_parquet(path):
        pf = require_pyarrow().ParquetFile(path)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_size):
            for obj in batch.to_pylist():
                row += 1
                yield row, obj
        return
    for lineno, text in HashingLineReader(path):
        if isinstance(text, ExampleError):
            yield lineno, text
            continue
        try:
            yield lineno, parse_json_object(text)
        except ExampleError as e:
            yield lineno, e


def write_parquet(path: str, rows: list) -> None:
    """Rows (dicts) to a parquet file (tests and tools/prepare_data.py)."""
    pq = require_pyarrow()
    import pyarrow as pa

    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's columns (not only the first's)
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
