"""Outputs of the local job (.jsonl, .npy, .parquet) and its errors file, written to survive a kill.

Each chunk of input rows [start, stop) is written, made durable (fsync), and only then
acknowledged; a rerun reads what is on disk and resumes at the first row not acknowledged,
so a row is written exactly once and never reported when it was not written:

    .jsonl    each line is a row with its `index`, appended and fsynced: the last complete line
              acknowledges every row up to its index (a torn last line is cut off)
    .npy      OUTPUT.partial, a float32 [num_rows, dim] .npy memmap (row i = input row i; a bad
              row is all NaN), plus OUTPUT.progress (JSON: rows_done, num_rows, dim) written
              atomically after the memmap is flushed; OUTPUT.partial becomes OUTPUT at the end
    .parquet  one part per chunk in OUTPUT.parts/part-<start>-<stop>.parquet, written under a
              temporary name, fsynced and renamed into place (the rename acknowledges the rows);
              merged into OUTPUT at the end (OUTPUT only ever appears whole)

A chunk's bad rows go to OUTPUT.errors.jsonl before the chunk's rows are written; a rerun drops
the reports of rows it has not acknowledged (it reads those rows again), so each bad row is
reported once too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidepool.jobs.durable import (
    Checkpoint,
    ChunkResult,
    Writer,
    no_checkpoint,
    sibling,
    write_atomic,
)
from tidepool.jobs.formats import JobError, check_suffix
from tidepool.jobs.npy_writer import NpyWriter
from tidepool.jobs.parquet_writer import ParquetWriter
from tidepool.jobs.rows import BadRow

__all__ = [
    "Checkpoint",
    "ChunkResult",
    "OUTPUT_FORMATS",
    "ErrorLog",
    "Writer",
    "errors_path",
    "has_output",
    "no_checkpoint",
    "open_writer",
    "remove_output",
]


# ---------------------------------------------------------------------- errors file


class ErrorLog:
    """OUTPUT.errors.jsonl: one JSON line per bad row ({"index", "line", "id", "error"})."""

    def __init__(self, path: Path, rows_done: int) -> None:
        self.path = path
        kept = self._reports_before(rows_done)
        if self.path.exists():
            write_atomic(self.path, b"".join(kept))
        self.num_errors = len(kept)

    def _reports_before(self, rows_done: int) -> list[bytes]:
        """The complete reports of acknowledged rows: the others are read (and reported) again."""
        if not self.path.exists():
            return []
        kept = []
        for line in self.path.read_bytes().splitlines(keepends=True):
            try:
                complete = line.endswith(b"\n") and json.loads(line)["index"] < rows_done
            except (ValueError, KeyError, TypeError):
                complete = False
            if complete:
                kept.append(line)
        return kept

    def append(self, bad_rows: list[BadRow]) -> None:
        if not bad_rows:
            return
        lines = []
        for bad in bad_rows:
            report: dict[str, Any] = {"index": bad.index, "line": bad.line}
            if bad.row_id is not None:
                report["id"] = bad.row_id
            report["error"] = bad.error
            lines.append(json.dumps(report, default=str) + "\n")
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        self.num_errors += len(bad_rows)

    def close(self) -> None:
        if self.num_errors == 0:
            self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------------- .jsonl


class JsonlWriter:
    def __init__(self, path: Path, checkpoint: Checkpoint) -> None:
        self.path = path
        self.checkpoint = checkpoint
        self.rows_done = self._resume()

    def _resume(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open("r+b") as f:
            size = f.seek(0, os.SEEK_END)
            end = _last_newline(f, size) + 1
            if end < size:  # a chunk was cut off mid-line: drop the torn line
                f.truncate(end)
                os.fsync(f.fileno())
            if end == 0:
                return 0
            begin = _last_newline(f, end - 1) + 1
            f.seek(begin)
            last = f.read(end - begin)
        try:
            return int(json.loads(last)["index"]) + 1
        except (ValueError, KeyError, TypeError) as e:
            raise JobError(
                f"{self.path}: its last line is not a row of this job; pass --overwrite"
            ) from e

    def write(self, chunk: ChunkResult) -> None:
        lines = []
        for row, vector in zip(chunk.rows, chunk.embeddings, strict=True):
            line: dict[str, Any] = {"index": row.index}
            if row.row_id is not None:
                line["id"] = row.row_id
            line["embedding"] = vector.tolist()
            lines.append(json.dumps(line) + "\n")
        data = "".join(lines).encode("utf-8")
        with self.path.open("ab") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            self.checkpoint("mid_write")
            f.write(data[len(data) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        self.checkpoint("before_ack")  # a line is its own acknowledgement
        self.rows_done = chunk.stop

    def finish(self) -> None:
        self.path.touch()


def _last_newline(f: Any, stop: int) -> int:
    """Offset of the last b"\\n" before `stop`, or -1."""
    block = 1 << 16
    end = stop
    while end > 0:
        begin = max(0, end - block)
        f.seek(begin)
        found = f.read(end - begin).rfind(b"\n")
        if found >= 0:
            return begin + found
        end = begin
    return -1


# ---------------------------------------------------------------------- opening


def errors_path(output: Path) -> Path:
    return sibling(output, ".errors.jsonl")


WriterFactory = Callable[[Path, int, str | None, Checkpoint], Writer]

WRITERS: dict[str, WriterFactory] = {
    ".jsonl": lambda path, num_rows, id_field, checkpoint: JsonlWriter(path, checkpoint),
    ".npy": lambda path, num_rows, id_field, checkpoint: NpyWriter(path, num_rows, checkpoint),
    ".parquet": ParquetWriter,
}
"""Output suffix → its writer (path, input rows, --id-field, checkpoint)."""
OUTPUT_FORMATS = tuple(WRITERS)

LEFTOVERS = (
    "",
    ".partial",
    ".progress",
    ".progress.tmp",
    ".tmp",
    ".errors.jsonl",
    ".manifest.json",
    ".manifest.json.tmp",
)
"""What a job may leave next to OUTPUT (OUTPUT itself included): --overwrite removes them (and
OUTPUT.parts/). OUTPUT.lock is the running job's lock (jobs/manifest.py), never removed here."""


MANIFEST_FILES = (".manifest.json", ".manifest.json.tmp")
"""The manifest and its half-written temporary file: LEFTOVERS that hold no rows."""


def has_output(path: Path) -> bool:
    """Whether anything of a job's output is on disk (rows, progress, parts, errors). The
    manifest's own files are not output: a job killed while writing its manifest leaves only
    OUTPUT.manifest.json.tmp, and the rerun starts afresh rather than refusing the output."""
    rows = [s for s in LEFTOVERS if s not in MANIFEST_FILES]
    return any(sibling(path, s).exists() for s in rows) or sibling(path, ".parts").exists()


def remove_output(path: Path) -> None:
    """--overwrite: everything a job left for OUTPUT."""
    for leftover in LEFTOVERS:
        sibling(path, leftover).unlink(missing_ok=True)
    shutil.rmtree(sibling(path, ".parts"), ignore_errors=True)


def open_writer(
    path: Path,
    num_rows: int,
    *,
    id_field: str | None,
    checkpoint: Checkpoint = no_checkpoint,
) -> Writer:
    """The writer of `path`, resumed from what is on disk."""
    suffix = check_suffix(path, tuple(WRITERS), "output")
    return WRITERS[suffix](path, num_rows, id_field, checkpoint)
