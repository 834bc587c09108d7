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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tidepool.jobs.formats import OUTPUT_FORMATS, JobError, check_suffix, require_pyarrow
from tidepool.jobs.rows import BadRow, Row

Checkpoint = Callable[[str], None]
"""Called at the named points of a job (tests kill the process there): "before_first_chunk",
"mid_write" (part of a chunk's rows written), "before_ack" (the rows durable, not yet
acknowledged), "after_ack", "before_finish", "mid_finish" (OUTPUT in place, leftovers not yet
removed)."""

PARQUET_ROWS_KEY = b"tidepool.rows_done"


def no_checkpoint(name: str) -> None:
    pass


@dataclass(frozen=True)
class ChunkResult:
    """One chunk of input rows, embedded: what a writer makes durable."""

    start: int
    """The chunk's first input row."""
    stop: int
    """One past its last input row: rows [start, stop) are acknowledged once it is written."""
    rows: list[Row]
    """The rows that have an embedding, in order."""
    embeddings: np.ndarray
    """[len(rows), dim] float32."""
    bad_rows: list[BadRow]
    """The chunk's rows without one, in order."""


class Writer(Protocol):
    rows_done: int
    """Input rows [0, rows_done) are acknowledged: the job resumes at this row."""

    def write(self, chunk: ChunkResult) -> None: ...

    def finish(self) -> None: ...


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` whole: temporary file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


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


# ---------------------------------------------------------------------- .npy


class NpyWriter:
    def __init__(self, path: Path, num_rows: int, checkpoint: Checkpoint) -> None:
        self.path = path
        self.num_rows = num_rows
        self.checkpoint = checkpoint
        self.partial = sibling(path, ".partial")
        self.progress_path = sibling(path, ".progress")
        self.array: np.memmap | None = None
        self.complete = False
        """OUTPUT was found whole: finish() has nothing left to do."""
        self.rows_done = self._resume()

    def _resume(self) -> int:
        progress = self._read_progress()
        if progress is None:
            # Nothing acknowledged: a partial file holds no row that can be trusted.
            self.partial.unlink(missing_ok=True)
            if self.path.exists():  # finished earlier (it only appears complete)
                self._check_finished()
                self.complete = True
                return self.num_rows
            return 0
        if progress["num_rows"] != self.num_rows:
            raise JobError(
                f"{self.path} is being written for an input of {progress['num_rows']} rows, "
                f"this input has {self.num_rows}: pass --overwrite to start again"
            )
        if not self.partial.exists() and self.path.exists():  # killed while finishing
            self._check_finished()
            self.progress_path.unlink()
            self.complete = True
            return self.num_rows
        if progress["dim"] is not None:
            self.array = self._open_partial(progress["dim"])
        return int(progress["rows_done"])

    def _read_progress(self) -> dict[str, Any] | None:
        if not self.progress_path.exists():
            return None
        try:
            progress = json.loads(self.progress_path.read_bytes())
            if {"rows_done", "num_rows", "dim"} <= progress.keys():
                return progress
        except (ValueError, AttributeError):
            pass
        raise JobError(f"{self.progress_path} is not a progress file of this job: --overwrite")

    def _open_partial(self, dim: int) -> np.memmap:
        try:
            array = np.load(self.partial, mmap_mode="r+")
        except (OSError, ValueError, EOFError) as e:
            raise JobError(f"{self.partial} is not readable ({e}): pass --overwrite") from e
        if array.shape != (self.num_rows, dim) or array.dtype != np.float32:
            raise JobError(f"{self.partial} holds {array.shape}, not ({self.num_rows}, {dim})")
        return array

    def _check_finished(self) -> None:
        try:
            shape = np.load(self.path, mmap_mode="r").shape
        except (OSError, ValueError, EOFError) as e:
            raise JobError(f"{self.path} is not a readable .npy ({e}): pass --overwrite") from e
        if shape[0] != self.num_rows:
            raise JobError(
                f"{self.path} already has {shape[0]} rows but the input has {self.num_rows}: "
                "is it the output of another input? pass --overwrite to start again"
            )

    def write(self, chunk: ChunkResult) -> None:
        if chunk.rows and self.array is None:  # the width is known once a row is embedded
            self.array = np.lib.format.open_memmap(
                self.partial,
                mode="w+",
                dtype=np.float32,
                shape=(self.num_rows, chunk.embeddings.shape[1]),
            )
            self.array[: chunk.start] = np.nan  # rows before: all bad
        if self.array is not None:
            block = np.full((chunk.stop - chunk.start, self.array.shape[1]), np.nan, np.float32)
            if chunk.rows:
                block[[row.index - chunk.start for row in chunk.rows]] = chunk.embeddings
            middle = chunk.start + len(block) // 2
            self.array[chunk.start : middle] = block[: middle - chunk.start]
            self.array.flush()
            self.checkpoint("mid_write")
            self.array[middle : chunk.stop] = block[middle - chunk.start :]
            self.array.flush()  # msync: the rows are durable before the progress file says so
        self.checkpoint("before_ack")
        dim = None if self.array is None else self.array.shape[1]
        progress = {"rows_done": chunk.stop, "num_rows": self.num_rows, "dim": dim}
        write_atomic(self.progress_path, json.dumps(progress).encode())
        self.rows_done = chunk.stop

    def finish(self) -> None:
        if self.complete:
            return
        if self.array is None:  # no row had an embedding: a [num_rows, 0] array says so
            with self.partial.open("wb") as f:
                np.save(f, np.zeros((self.num_rows, 0), dtype=np.float32))
                f.flush()
                os.fsync(f.fileno())
        else:
            self.array.flush()
            self.array = None
        self.checkpoint("before_finish")
        os.replace(self.partial, self.path)
        _fsync_dir(self.path.parent)
        self.checkpoint("mid_finish")
        self.progress_path.unlink(missing_ok=True)


# ---------------------------------------------------------------------- .parquet


class ParquetWriter:
    def __init__(
        self, path: Path, num_rows: int, id_field: str | None, checkpoint: Checkpoint
    ) -> None:
        self.pq = require_pyarrow()
        self.path = path
        self.num_rows = num_rows
        self.with_ids = id_field is not None
        self.checkpoint = checkpoint
        self.parts_dir = sibling(path, ".parts")
        self.complete = False
        """OUTPUT was found whole: finish() has nothing left to do."""
        self.rows_done = self._resume()

    def _resume(self) -> int:
        if self.path.exists():  # OUTPUT appears whole, at the end: the job was complete
            shutil.rmtree(self.parts_dir, ignore_errors=True)  # killed before cleaning up
            metadata = self.pq.read_schema(self.path).metadata or {}
            rows_done = int(
                metadata.get(PARQUET_ROWS_KEY, self.pq.read_metadata(self.path).num_rows)
            )
            if rows_done != self.num_rows:
                raise JobError(
                    f"{self.path} is complete for {rows_done} rows but the input has "
                    f"{self.num_rows}: pass --overwrite to start again"
                )
            self.complete = True
            return rows_done
        if not self.parts_dir.exists():
            return 0
        for leftover in self.parts_dir.glob("*.tmp"):
            leftover.unlink()
        rows_done = 0
        for part in self._parts():
            start, stop = _part_range(part)
            try:
                self.pq.read_metadata(part)
            except Exception as e:  # pyarrow raises several kinds for a bad footer
                raise JobError(f"{part} is not readable ({e}): pass --overwrite") from e
            if start != rows_done:
                raise JobError(f"{self.parts_dir} misses rows {rows_done}-{start}: --overwrite")
            rows_done = stop
        return rows_done

    def _parts(self) -> list[Path]:
        return sorted(self.parts_dir.glob("part-*.parquet"))

    def write(self, chunk: ChunkResult) -> None:
        import pyarrow as pa

        if chunk.rows:  # a chunk of bad rows only is acknowledged by the next part
            columns: dict[str, Any] = {"index": pa.array([r.index for r in chunk.rows], pa.int64())}
            if self.with_ids:
                columns["id"] = pa.array([r.row_id for r in chunk.rows])
            flat = pa.array(chunk.embeddings.reshape(-1), type=pa.float32())
            width = chunk.embeddings.shape[1]
            columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, width)
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            part = self.parts_dir / f"part-{chunk.start:012d}-{chunk.stop:012d}.parquet"
            tmp = part.with_suffix(".tmp")
            with tmp.open("wb") as f:
                self.pq.write_table(pa.table(columns), f)
                f.flush()
                os.fsync(f.fileno())
            self.checkpoint("mid_write")
            os.replace(tmp, part)
            _fsync_dir(self.parts_dir)
        self.checkpoint("before_ack")
        self.rows_done = chunk.stop

    def finish(self) -> None:
        import pyarrow as pa

        if self.complete:
            return
        parts = self._parts() if self.parts_dir.exists() else []
        schemas = [self.pq.read_schema(part) for part in parts]
        # Parts whose ids were all null have a null id type: unify it with the others'.
        schema = pa.unify_schemas(schemas, promote_options="default") if schemas else None
        schema = schema or pa.schema([("index", pa.int64())])
        schema = schema.with_metadata({PARQUET_ROWS_KEY: str(self.num_rows).encode()})
        tmp = sibling(self.path, ".tmp")
        with tmp.open("wb") as f:
            writer = self.pq.ParquetWriter(f, schema)
            for part in parts:
                writer.write_table(self.pq.read_table(part).cast(schema))
            writer.close()
            f.flush()
            os.fsync(f.fileno())
        self.checkpoint("before_finish")
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.checkpoint("mid_finish")
        shutil.rmtree(self.parts_dir, ignore_errors=True)


def _part_range(part: Path) -> tuple[int, int]:
    _, start, stop = part.stem.split("-")
    return int(start), int(stop)


# ---------------------------------------------------------------------- opening


def errors_path(output: Path) -> Path:
    return sibling(output, ".errors.jsonl")


def open_writer(
    path: Path,
    num_rows: int,
    *,
    overwrite: bool,
    id_field: str | None,
    checkpoint: Checkpoint = no_checkpoint,
) -> Writer:
    suffix = check_suffix(path, OUTPUT_FORMATS, "output")
    if overwrite:
        for suffix_of_leftover in ("", ".partial", ".progress", ".tmp", ".errors.jsonl"):
            sibling(path, suffix_of_leftover).unlink(missing_ok=True)
        shutil.rmtree(sibling(path, ".parts"), ignore_errors=True)
    if suffix == ".jsonl":
        return JsonlWriter(path, checkpoint)
    if suffix == ".npy":
        return NpyWriter(path, num_rows, checkpoint)
    return ParquetWriter(path, num_rows, id_field, checkpoint)
