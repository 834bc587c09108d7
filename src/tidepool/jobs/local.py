"""`tidepool embed`: embed a local file of texts in chunks, resumably, on one engine.

The engine is any object with `LLM.encode`'s signature (the CLI passes a `tidepool.LLM`); this
package never builds one. Rows come from `tidepool.jobs.rows` (one rule for counting and
reading), outputs are written by `tidepool.jobs.writers` (durable before acknowledged).

The error policy: a bad row (see `tidepool.jobs.rows`, or one the engine refuses, e.g. too long
with --no-truncate) is reported with its row and line number in OUTPUT.errors.jsonl and
skipped; the good rows of its chunk are written. `on_error="skip"` (the default) goes on to the
end, and the CLI then exits with status 1; `on_error="fail"` writes the rows before the first
bad row and stops there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tidepool.jobs.formats import JobError, count_rows, iter_rows
from tidepool.jobs.pooling import PooledRows, pool_rows
from tidepool.jobs.rows import AnyRow, BadRow, Row
from tidepool.jobs.writers import (
    Checkpoint,
    ChunkResult,
    ErrorLog,
    Writer,
    errors_path,
    no_checkpoint,
    open_writer,
)

ON_ERROR = ("skip", "fail")
NUM_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class EmbedJob:
    """The settings of one local job (the CLI's flags)."""

    input: Path
    """A .txt, .jsonl or .parquet file."""
    output: Path
    """A .jsonl, .parquet or .npy file (its siblings OUTPUT.* hold progress and errors)."""
    text_field: str = "text"
    """The .jsonl key / parquet column of the texts."""
    id_field: str | None = None
    """A .jsonl key / parquet column copied to the output as `id`."""
    chunk_size: int = 512
    """Input rows per engine call and per write."""
    truncate_prompt_tokens: int | None = -1
    """Keep the first N tokens; -1: the model's maximum; None: a longer row is a bad row."""
    dimensions: int | None = None
    """Matryoshka truncation."""
    overwrite: bool = False
    """Start again instead of resuming."""
    progress: bool = True
    """Show a progress bar."""
    on_error: str = "skip"
    """"skip": report bad rows and go on; "fail": stop at the first one."""

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}")


@dataclass(frozen=True)
class JobResult:
    """What one run of a job did."""

    num_rows: int
    """Rows of the input."""
    num_resumed: int
    """Rows acknowledged by earlier runs (this run started after them)."""
    num_embedded: int
    """Rows this run embedded and wrote."""
    num_skipped: int
    """Bad rows in the errors file (this run's and earlier runs')."""
    errors_path: Path
    """Where the bad rows are listed (absent when there are none)."""
    first_errors: list[BadRow] = field(default_factory=list)
    """This run's first bad rows (at most NUM_ERRORS_SHOWN)."""
    stopped_at: BadRow | None = None
    """With on_error="fail": the bad row the job stopped at."""


def embed_chunk(llm: Any, rows: list[Row], job: EmbedJob) -> PooledRows:
    """The engine over one chunk's good rows: [len(rows), dim] values and per-row errors."""
    from tidepool.params import PoolingParams

    return pool_rows(
        llm,
        "embed",
        [row.text for row in rows],
        pooling_params=PoolingParams(dimensions=job.dimensions),
        truncate_prompt_tokens=job.truncate_prompt_tokens,
    )


def _chunks(rows: Iterator[AnyRow], size: int, stop_at_bad: bool) -> Iterator[list[AnyRow]]:
    chunk: list[AnyRow] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size or (stop_at_bad and isinstance(row, BadRow)):
            yield chunk
            chunk = []
            if stop_at_bad and isinstance(row, BadRow):
                return
    if chunk:
        yield chunk


def _embed(llm: Any, chunk: list[AnyRow], job: EmbedJob) -> ChunkResult:
    good = [row for row in chunk if isinstance(row, Row)]
    bad = [row for row in chunk if isinstance(row, BadRow)]
    kept: list[Row] = []
    vectors: np.ndarray = np.zeros((0, 0), dtype=np.float32)
    if good:
        pooled = embed_chunk(llm, good, job)
        keep = [error is None for error in pooled.errors]
        for row, error in zip(good, pooled.errors, strict=True):
            if error is None:
                kept.append(row)
            else:
                bad.append(BadRow(row.index, row.line, error, row.row_id))
        vectors = np.ascontiguousarray(pooled.values[np.array(keep, dtype=bool)], np.float32)
    bad.sort(key=lambda row: row.index)
    return ChunkResult(chunk[0].index, chunk[-1].index + 1, kept, vectors, bad)


def _cut_before(result: ChunkResult, bad: BadRow) -> ChunkResult:
    """on_error="fail": the rows before the first bad row, and that row's report."""
    rows = [row for row in result.rows if row.index < bad.index]
    return ChunkResult(result.start, bad.index, rows, result.embeddings[: len(rows)], [bad])


def _open(job: EmbedJob, checkpoint: Checkpoint) -> tuple[int, Writer, ErrorLog]:
    num_rows = count_rows(job.input)
    writer = open_writer(
        job.output,
        num_rows,
        overwrite=job.overwrite,
        id_field=job.id_field,
        checkpoint=checkpoint,
    )
    if writer.rows_done > num_rows:
        raise JobError(
            f"{job.output} already has {writer.rows_done} rows but {job.input} has {num_rows}: "
            "is it the output of another input? pass --overwrite to start again"
        )
    return num_rows, writer, ErrorLog(errors_path(job.output), writer.rows_done)


def run_embed_job(llm: Any, job: EmbedJob, checkpoint: Checkpoint = no_checkpoint) -> JobResult:
    """Embed every row not yet acknowledged in the output; see the module's error policy."""
    from tqdm.auto import tqdm

    num_rows, writer, errors = _open(job, checkpoint)
    start = writer.rows_done
    if start:
        print(f"resuming: {start} of {num_rows} rows are already in {job.output}")
    num_embedded = 0
    first_errors: list[BadRow] = []
    stopped_at: BadRow | None = None
    bar = tqdm(total=num_rows, initial=start, unit="row", disable=not job.progress)
    try:
        checkpoint("before_first_chunk")
        rows = iter_rows(job.input, job.text_field, job.id_field, start)
        for chunk in _chunks(rows, job.chunk_size, stop_at_bad=job.on_error == "fail"):
            result = _embed(llm, chunk, job)
            if job.on_error == "fail" and result.bad_rows:
                stopped_at = result.bad_rows[0]
                result = _cut_before(result, stopped_at)
            errors.append(result.bad_rows)  # reported before the rows are acknowledged
            writer.write(result)
            checkpoint("after_ack")
            num_embedded += len(result.rows)
            first_errors.extend(result.bad_rows[: NUM_ERRORS_SHOWN - len(first_errors)])
            bar.update(result.stop - result.start)
            if stopped_at is not None:
                break
    finally:
        bar.close()
    if stopped_at is None:
        writer.finish()
    errors.close()
    return JobResult(
        num_rows=num_rows,
        num_resumed=start,
        num_embedded=num_embedded,
        num_skipped=errors.num_errors,
        errors_path=errors.path,
        first_errors=first_errors,
        stopped_at=stopped_at,
    )
