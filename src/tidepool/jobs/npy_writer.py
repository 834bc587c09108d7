"""The .npy output: OUTPUT.partial (a memmap) and OUTPUT.progress, OUTPUT only when done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from tidepool.jobs.durable import Checkpoint, ChunkResult, fsync_dir, sibling, write_atomic
from tidepool.jobs.formats import JobError


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
        sibling(self.progress_path, ".tmp").unlink(missing_ok=True)  # a replace cut short
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
        fsync_dir(self.path.parent)
        self.checkpoint("mid_finish")
        self.progress_path.unlink(missing_ok=True)
