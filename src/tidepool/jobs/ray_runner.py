"""`tidepool embed --ray ADDRESS`: the batch job on a Ray cluster, resumable file by file.

Planning and the output folder: `tidepool.jobs.plan`. Each shard is read with the local job's
row reader (`tidepool.jobs.rows`), embedded by one actor's engine (`tidepool.ray.Predictor`),
written under `_tmp/`, moved into place, and only then gets its marker; `_`-prefixed paths are
skipped by pyarrow and Ray readers, so reading OUTPUT as a dataset sees whole files only.

Columns: `source` (input file, relative to INPUT), `index` (the row in that file, as in
`tidepool embed`), `id` (with --id-field; one type in every file: the parquet inputs' type when
they agree, else text), `embedding` (float32, null for a bad row) and `error` (why a row has no
embedding, else null). The error policy is the local job's: a bad row (see `tidepool.jobs.rows`,
or too long with --no-truncate) is reported, with its line number, and never stops the job;
here the report is the row's `error`, so every input row has an output row.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tidepool.jobs.formats import JobError
from tidepool.jobs.manifest import OutputLock
from tidepool.jobs.plan import (
    DONE_DIR,
    SUCCESS,
    TMP_DIR,
    JobPlan,
    RayEmbedJob,
    Shard,
    canonical_uri,
    completed_shards,
    plan_job,
    prepare_output,
    write_json,
)
from tidepool.jobs.rows import AnyRow, BadRow, Row, iter_row_lines, make_row, parse_line
from tidepool.ray.data import Predictor, arrow_column, error_column
from tidepool.ray.pooling import PooledRows

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs


@dataclass(frozen=True)
class JobSummary:
    num_shards: int
    num_skipped: int
    num_rows: int
    """Rows written by this run."""
    num_errors: int
    """Rows of this run with an error instead of an embedding."""


# ---------------------------------------------------------------------- reading one shard


@dataclass(frozen=True)
class ShardRows:
    """One shard's rows, as the local job reads them (bad rows included, in order)."""

    rows: list[AnyRow]
    """Row or BadRow per input row of the shard."""

    @property
    def texts(self) -> list[Any]:
        return [row.text if isinstance(row, Row) else None for row in self.rows]

    @property
    def ids(self) -> list[Any]:
        return [row.row_id for row in self.rows]

    @property
    def read_errors(self) -> list[str | None]:
        """Per row: None, or why it cannot be embedded (with its line number)."""
        return [_report(row) if isinstance(row, BadRow) else None for row in self.rows]


def _report(bad: BadRow) -> str:
    return bad.error if bad.line is None else f"{bad.error} (line {bad.line})"


def read_shard(
    fs: pafs.FileSystem, shard: Shard, text_field: str, id_field: str | None
) -> ShardRows:
    if shard.kind == "parquet":
        return _read_parquet_rows(fs, shard, text_field, id_field)
    with fs.open_input_file(shard.path) as f:
        f.seek(shard.byte_start)
        data = f.read(shard.byte_stop - shard.byte_start)
    lines = iter_row_lines(io.BytesIO(data), shard.line_start, shard.byte_start)
    rows = [
        parse_line(line, shard.row_start + k, shard.kind, text_field, id_field)
        for k, line in enumerate(lines)
    ]
    if len(rows) != shard.row_stop - shard.row_start:
        raise JobError(f"{shard.path} changed since the job was planned; rerun it")
    return ShardRows(rows)


def _read_parquet_rows(
    fs: pafs.FileSystem, shard: Shard, text_field: str, id_field: str | None
) -> ShardRows:
    import pyarrow.parquet as pq

    columns = [text_field] + ([id_field] if id_field else [])
    with fs.open_input_file(shard.path) as f:
        file = pq.ParquetFile(f)
        # Read only the row groups that overlap the shard, then cut it out of them.
        groups, first_row, group_start = [], None, 0
        for i in range(file.num_row_groups):
            group_stop = group_start + file.metadata.row_group(i).num_rows
            if group_start < shard.row_stop and group_stop > shard.row_start:
                groups.append(i)
                first_row = group_start if first_row is None else first_row
            group_start = group_stop
        table = file.read_row_groups(groups, columns=columns)
    table = table.slice(shard.row_start - (first_row or 0), shard.row_stop - shard.row_start)
    texts = table.column(text_field).to_pylist()
    ids = table.column(id_field).to_pylist() if id_field else [None] * len(texts)
    rows = [
        make_row(shard.row_start + k, None, text, row_id)
        for k, (text, row_id) in enumerate(zip(texts, ids, strict=True))
    ]
    return ShardRows(rows)


# ---------------------------------------------------------------------- the actor


class ShardWriter:
    """One engine per actor; each call embeds whole shards and writes them, marker last."""

    def __init__(
        self,
        job: RayEmbedJob,
        input_fs: pafs.FileSystem,
        output_fs: pafs.FileSystem,
        output: str,
        id_type: pa.DataType | None,
    ) -> None:
        self.job = job
        self.input_fs = input_fs
        self.output_fs = output_fs
        self.output = output
        self.id_type = id_type
        self.predictor = Predictor(
            job.model,
            task="embed",
            dimensions=job.dimensions,
            truncate_prompt_tokens=job.truncate_prompt_tokens,
            num_threads=max(1, int(job.cpus_per_actor)),
            engine_kwargs=job.engine_kwargs,
        )

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow as pa

        written = [self.write_shard(Shard(**row)) for row in batch.to_pylist()]
        names, num_rows, num_errors = zip(*written, strict=True) if written else ((), (), ())
        return pa.table(
            {
                "name": pa.array(names, pa.string()),
                "num_rows": pa.array(num_rows, pa.int64()),
                "num_errors": pa.array(num_errors, pa.int64()),
            }
        )

    def write_shard(self, shard: Shard) -> tuple[str, int, int]:
        import pyarrow.parquet as pq

        rows = read_shard(self.input_fs, shard, self.job.text_field, self.job.id_field)
        pooled = self._embed(rows)
        table = self._table(shard, rows, pooled)
        tmp = f"{self.output}/{TMP_DIR}/{shard.name}.{uuid.uuid4().hex}"
        self.output_fs.create_dir(f"{self.output}/{TMP_DIR}", recursive=True)
        pq.write_table(table, tmp, filesystem=self.output_fs)
        self.output_fs.move(tmp, f"{self.output}/{shard.name}")
        num_errors = sum(e is not None for e in pooled.errors)
        marker = {**asdict(shard), "num_rows": table.num_rows, "num_errors": num_errors}
        write_json(self.output_fs, f"{self.output}/{DONE_DIR}/{shard.name}.json", marker)
        return shard.name, table.num_rows, num_errors

    def _embed(self, rows: ShardRows) -> PooledRows:
        """Embed the good rows chunk by chunk; bad ones keep their report."""
        errors = rows.read_errors
        good = [i for i, row in enumerate(rows.rows) if isinstance(row, Row)]
        texts = rows.texts
        parts = []
        for start in range(0, len(good), self.job.chunk_size):
            chunk = good[start : start + self.job.chunk_size]
            pooled = self.predictor.pool([texts[i] for i in chunk])
            for i, error in zip(chunk, pooled.errors, strict=True):
                errors[i] = error
            parts.append((chunk, pooled.values))
        width = max((values.shape[1] for _, values in parts), default=0)
        values = np.zeros((len(errors), width), dtype=np.float32)
        for chunk, chunk_values in parts:
            if chunk_values.shape[1]:
                values[chunk] = chunk_values
        return PooledRows(values, errors)

    def _table(self, shard: Shard, rows: ShardRows, pooled: PooledRows) -> pa.Table:
        import pyarrow as pa

        num_rows = len(rows.rows)
        columns: dict[str, Any] = {
            "source": pa.array([shard.source] * num_rows, pa.string()),
            "index": pa.array(range(shard.row_start, shard.row_stop), pa.int64()),
        }
        if self.job.id_field:
            columns["id"] = _id_array(rows.ids, self.id_type)
        columns["embedding"] = arrow_column(pooled, "float32", self.predictor.output_width(pooled))
        columns["error"] = error_column(pooled)
        return pa.table(columns)


def _id_array(ids: list[Any], id_type: pa.DataType) -> pa.Array:
    import pyarrow as pa

    if id_type == pa.string():  # .jsonl ids may be numbers or text: all become text
        return pa.array([None if i is None else str(i) for i in ids], pa.string())
    return pa.array(ids, type=id_type)


# ---------------------------------------------------------------------- the job


def run_ray_embed_job(job: RayEmbedJob, address: str | None = None) -> JobSummary:
    """Plan the shards, skip the complete ones, embed the rest on Ray.

    Ray is joined at `address` (see `connect`) only when there is work left, and left again
    afterwards; with None, the caller has called `ray.init` already.
    """
    plan = plan_job(job)
    with _output_lock(job.output):
        return _run_planned(job, plan, address)


def _output_lock(output: str) -> contextlib.AbstractContextManager[Any]:
    """A local OUTPUT folder is locked as the local job's output is (OUTPUT.lock beside it, an
    exclusive flock): a second job on it stops at once. A URI has no OS lock to take."""
    if "://" in output:
        return contextlib.nullcontext()
    folder = Path(canonical_uri(output))
    if not folder.parent.is_dir():
        raise JobError(f"the output's folder {folder.parent} does not exist")
    return OutputLock(folder.with_name(folder.name + ".lock"), output)


def _run_planned(job: RayEmbedJob, plan: JobPlan, address: str | None) -> JobSummary:
    import pyarrow.fs as pafs

    output_fs, output_path = plan.output_fs, plan.output_path
    settings = job.settings(canonical_uri(job.input), plan)
    prepare_output(output_fs, output_path, settings, job.overwrite)
    done = completed_shards(output_fs, output_path)
    pending = [shard for shard in plan.shards if shard.name not in done]
    num_shards = len(plan.shards)
    if len(pending) < num_shards:
        print(f"resuming: {num_shards - len(pending)} of {num_shards} files are complete")
    results = []
    if pending:
        started = connect(address) if address is not None else False
        try:
            results = _run_shards(pending, job, plan)
        finally:
            if started:
                import ray

                ray.shutdown()
    missing = {s.name for s in plan.shards} - completed_shards(output_fs, output_path)
    if missing:
        raise JobError(f"{len(missing)} shards have no completion marker, e.g. {min(missing)}")
    if output_fs.get_file_info(f"{output_path}/{TMP_DIR}").type == pafs.FileType.Directory:
        output_fs.delete_dir(f"{output_path}/{TMP_DIR}")
    write_json(output_fs, f"{output_path}/{SUCCESS}", {"num_shards": num_shards})
    return JobSummary(
        num_shards=num_shards,
        num_skipped=num_shards - len(pending),
        num_rows=sum(r["num_rows"] for r in results),
        num_errors=sum(r["num_errors"] for r in results),
    )


def _run_shards(pending: list[Shard], job: RayEmbedJob, plan: JobPlan) -> list[dict[str, Any]]:
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    DataContext.get_current().enable_progress_bars = job.progress
    num_actors = job.num_actors or int(ray.cluster_resources().get("CPU", 1) // job.cpus_per_actor)
    num_actors = max(1, min(num_actors, len(pending)))
    # One shard per call: a retried call (the actor died) rewrites exactly that shard.
    ds = ray.data.from_items([asdict(shard) for shard in pending])
    written = ds.map_batches(
        ShardWriter,
        fn_constructor_args=(job, plan.input_fs, plan.output_fs, plan.output_path, plan.id_type),
        compute=ActorPoolStrategy(size=num_actors),
        num_cpus=job.cpus_per_actor,
        batch_size=1,
        batch_format="pyarrow",
    )
    return written.take_all()


def connect(address: str) -> bool:
    """Join the cluster at `address` ('auto': this machine's; 'local': start one here);
    True if this call started the connection (and so should end it)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=None if address == "local" else address)
    return True
