"""Input formats of the batch jobs: which files are inputs and outputs, and reading a local input.

Inputs: .txt (one text per row line), .jsonl (a JSON string or an object with the text field
per row line), .parquet (a text column). What a line and a row are: `tidepool.jobs.rows`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidepool.jobs.rows import AnyRow, count_line_rows, iter_row_lines, make_row, parse_line

INPUT_FORMATS = (".txt", ".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 4096


class JobError(Exception):
    """A problem the user must fix (bad file, wrong format); printed without a traceback."""


def require_pyarrow() -> Any:
    """pyarrow.parquet, or a JobError that says how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise JobError(
            "parquet needs pyarrow, which is not installed: pip install 'tidepool[parquet]' "
            "(or pip install pyarrow)"
        ) from e
    return pq


def check_suffix(path: Path | str, allowed: tuple[str, ...], what: str) -> str:
    """The lower-case suffix of `path`, which must be one of `allowed`."""
    suffix = Path(str(path)).suffix.lower()
    if suffix not in allowed:
        raise JobError(f"{what} {path} has an unknown format {suffix!r}; use {', '.join(allowed)}")
    return suffix


def count_rows(path: Path) -> int:
    """The input's rows: what `iter_rows` yields from row 0 (by the same line rule)."""
    suffix = check_suffix(path, INPUT_FORMATS, "input")
    if suffix == ".parquet":
        return require_pyarrow().ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return count_line_rows(f)


def iter_rows(path: Path, text_field: str, id_field: str | None, start: int) -> Iterator[AnyRow]:
    """The input's rows from row `start` on, each a Row or a BadRow (never raises for a row)."""
    suffix = check_suffix(path, INPUT_FORMATS, "input")
    if suffix == ".parquet":
        yield from iter_parquet_rows(path, text_field, id_field, start)
        return
    kind = suffix[1:]
    with path.open("rb") as f:
        for index, line in enumerate(iter_row_lines(f)):
            if index >= start:  # rows before `start` are counted, not parsed
                yield parse_line(line, index, kind, text_field, id_field)


def iter_parquet_rows(
    source: Any, text_field: str, id_field: str | None, start: int
) -> Iterator[AnyRow]:
    """Rows of a parquet file (a path or an open file) from row `start` on."""
    pq = require_pyarrow()
    file = pq.ParquetFile(source)
    columns = parquet_columns(file, str(source), text_field, id_field)
    index = 0
    for batch in file.iter_batches(columns=columns, batch_size=PARQUET_BATCH_ROWS):
        if index + batch.num_rows <= start:
            index += batch.num_rows
            continue
        texts = batch.column(text_field).to_pylist()
        ids = batch.column(id_field).to_pylist() if id_field else [None] * len(texts)
        for text, row_id in zip(texts, ids, strict=True):
            if index >= start:
                yield make_row(index, None, text, row_id)
            index += 1


def parquet_columns(file: Any, name: str, text_field: str, id_field: str | None) -> list[str]:
    """The columns a job reads; a JobError naming the file when one is missing."""
    columns = [text_field] + ([id_field] if id_field else [])
    names = file.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise JobError(f"{name} has no column {missing[0]!r}; columns: {names}")
    return columns
