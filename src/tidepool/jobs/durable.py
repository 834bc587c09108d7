"""What every local output shares: a chunk's result, the writer contract, durable writes."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from tidepool.jobs.rows import BadRow, Row

Checkpoint = Callable[[str], None]
"""Called at the named points of a job (tests kill the process there): "before_first_chunk",
"mid_write" (part of a chunk's rows written), "before_ack" (the rows durable, not yet
acknowledged), "after_ack", "before_finish", "mid_finish" (OUTPUT in place, leftovers not yet
removed)."""


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
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)
