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

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tidepool.jobs.durable import sibling, write_atomic
from tidepool.jobs.formats import INPUT_FORMATS, JobError, check_suffix, count_rows, iter_rows
from tidepool.jobs.manifest import (
    MANIFEST_VERSION,
    OutputLock,
    differences,
    file_fingerprint,
    model_fields,
    read_manifest,
    refuse_other_job,
)
from tidepool.jobs.rows import AnyRow, BadRow, Row
from tidepool.jobs.writers import (
    OUTPUT_FORMATS,
    Checkpoint,
    ChunkResult,
    ErrorLog,
    Writer,
    errors_path,
    has_output,
    no_checkpoint,
    open_writer,
    remove_output,
)
from tidepool.ray.pooling import OfflineLLM, PooledRows, pool_rows

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
    normalize: bool | None = None
    """L2-normalize the embeddings; None: as the model's sentence-transformers modules say."""
    prompt_name: str | None = None
    """One of the model's prompts put before each text; None: its default prompt, if any."""
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


def embed_chunk(llm: OfflineLLM, rows: list[Row], job: EmbedJob) -> PooledRows:
    """The engine over one chunk's good rows: [len(rows), dim] values and per-row errors."""
    from tidepool.params import PoolingParams

    return pool_rows(
        llm,
        "embed",
        [row.text for row in rows],
        pooling_params=PoolingParams(
            dimensions=job.dimensions, normalize=job.normalize, prompt_name=job.prompt_name
        ),
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


def _embed(llm: OfflineLLM, chunk: list[AnyRow], job: EmbedJob) -> ChunkResult:
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


def manifest_path(output: Path) -> Path:
    return sibling(output, ".manifest.json")


def job_manifest(llm: OfflineLLM, job: EmbedJob) -> dict[str, Any]:
    """Everything that decides the output's rows (jobs/manifest.py): a rerun resumes only when
    every field is the same."""
    return {
        "manifest_version": MANIFEST_VERSION,
        **model_fields(getattr(llm, "model_config", None)),
        "task": "embed",
        "dimensions": job.dimensions,
        "normalize": job.normalize,
        "prompt_name": job.prompt_name,
        "truncate_prompt_tokens": job.truncate_prompt_tokens,
        "output_format": job.output.suffix.lower(),
        "text_field": job.text_field,
        "id_field": job.id_field,
        "input": file_fingerprint(job.input),
    }


def _check_manifest(llm: OfflineLLM, job: EmbedJob) -> None:
    """Write the manifest of a new output; refuse an existing output of other settings before
    anything of it is touched."""
    path = manifest_path(job.output)
    wanted = job_manifest(llm, job)
    recorded = read_manifest(path)
    if recorded is None:
        if has_output(job.output):
            raise JobError(
                f"{job.output} holds rows but no manifest ({path.name}): it was not written by "
                "this version of tidepool embed, so it cannot be resumed; pass --overwrite"
            )
        write_atomic(path, json.dumps(wanted, indent=1).encode("utf-8"))
        return
    changed = differences(recorded, wanted)
    if changed:
        raise refuse_other_job(str(job.output), changed)


def _open(llm: OfflineLLM, job: EmbedJob, checkpoint: Checkpoint) -> tuple[int, Writer, ErrorLog]:
    num_rows = count_rows(job.input)
    if job.overwrite:
        remove_output(job.output)
    _check_manifest(llm, job)
    writer = open_writer(job.output, num_rows, id_field=job.id_field, checkpoint=checkpoint)
    if writer.rows_done > num_rows:
        raise JobError(
            f"{job.output} already has {writer.rows_done} rows but {job.input} has {num_rows}: "
            "is it the output of another input? pass --overwrite to start again"
        )
    return num_rows, writer, ErrorLog(errors_path(job.output), writer.rows_done)


def check_input_path(path: Path) -> None:
    """A JobError for an input that is not a regular file (checked before a model is loaded)."""
    if not path.exists():
        raise JobError(f"no input file {path}")
    if path.is_dir():
        raise JobError(
            f"the input {path} is a folder: give a file (.txt, .jsonl or .parquet); "
            "--ray reads a folder of files"
        )
    if not path.is_file():
        raise JobError(
            f"the input {path} is not a regular file (a device, pipe or socket): give a .txt, "
            ".jsonl or .parquet file"
        )
    check_suffix(path, INPUT_FORMATS, "input")
    if not os.access(path, os.R_OK):
        raise JobError(f"the input {path} cannot be read: permission denied")


def check_output_path(output: Path) -> None:
    """A JobError for an output that cannot be written: a folder, or in a folder that is
    missing or not writable (checked before a model is loaded)."""
    if output.is_dir():
        raise JobError(f"the output {output} is a folder: give a file (.jsonl, .parquet or .npy)")
    check_suffix(output, OUTPUT_FORMATS, "output")
    folder = output.parent
    if not folder.is_dir():
        raise JobError(f"the output's folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        output.exists() and not os.access(output, os.W_OK)
    ):
        raise JobError(f"the output {output} cannot be written here: permission denied")


def run_embed_job(
    llm: OfflineLLM, job: EmbedJob, checkpoint: Checkpoint = no_checkpoint
) -> JobResult:
    """Embed every row not yet acknowledged in the output; see the module's error policy. The
    output is locked for the whole run: a second job on it stops at once (jobs/manifest.py)."""
    check_input_path(job.input)
    check_output_path(job.output)
    with OutputLock(sibling(job.output, ".lock"), job.output):
        return _run_locked(llm, job, checkpoint)


def _run_locked(llm: OfflineLLM, job: EmbedJob, checkpoint: Checkpoint) -> JobResult:
    from tqdm.auto import tqdm

    num_rows, writer, errors = _open(llm, job, checkpoint)
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
