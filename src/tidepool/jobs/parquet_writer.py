"""The .parquet output: one part per chunk in OUTPUT.parts/, merged into OUTPUT when done."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tidepool.jobs.durable import Checkpoint, ChunkResult, fsync_dir, sibling
from tidepool.jobs.formats import JobError, require_pyarrow

PARQUET_ROWS_KEY = b"tidepool.rows_done"
"""Schema metadata of OUTPUT: the input rows the complete job covered (bad rows included)."""


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
            fsync_dir(self.parts_dir)
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
        fsync_dir(self.path.parent)
        self.checkpoint("mid_finish")
        shutil.rmtree(self.parts_dir, ignore_errors=True)


def _part_range(part: Path) -> tuple[int, int]:
    _, start, stop = part.stem.split("-")
    return int(start), int(stop)
