"""`tidepool embed --ray ADDRESS`: the batch job on a Ray cluster, resumable file by file.

INPUT is a file or a folder (searched recursively) of .parquet / .jsonl / .txt files, local or on
any filesystem pyarrow knows (s3://, gs://, hdfs://, ...). OUTPUT is a folder of parquet files:

    OUTPUT/_tidepool_job.json                    the settings that decide the results (model,
                                                 dtype, input, fields, rows per file, ...)
    OUTPUT/<stem>-<hash8>-<row_start>.parquet    one file per shard: rows [row_start, row_stop)
                                                 of one input file (--rows-per-file rows)
    OUTPUT/_done/<same name>.json                written after its parquet file is complete
    OUTPUT/_SUCCESS                              written when every shard has its marker

A shard's name depends only on its input file's path (relative to INPUT: `hash8`) and its first
row, so a rerun plans the same shards and skips those with a marker; an actor that died mid-shard
left no marker and the shard is written again. Parquet files are written under `_tmp/` and
moved into place, and `_`-prefixed paths are skipped by pyarrow and Ray readers, so reading
OUTPUT as a dataset sees whole files only.

Columns: `source` (input file, relative to INPUT), `index` (row in that file: blank lines of
.jsonl / .txt are not rows, as in `tidepool embed`), `id` (with --id-field; one type in every
file: the parquet inputs' type when they agree, else text), `embedding`
(float32, null for a bad row) and `error` (why a row has no embedding, else null). A bad row
(empty text, not a string, not JSON, too long with --no-truncate) is reported, never fatal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import posixpath
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tidepool.entrypoints.batch_embed import JobError
from tidepool.ray.data import PooledRows, Predictor, arrow_column, error_column

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

INPUT_SUFFIXES = (".parquet", ".jsonl", ".txt")
MANIFEST = "_tidepool_job.json"
DONE_DIR = "_done"
TMP_DIR = "_tmp"
SUCCESS = "_SUCCESS"
_READ_BLOCK_BYTES = 1 << 24


@dataclass(frozen=True)
class RayEmbedJob:
    input: str
    """A file or folder, local or a URI."""
    output: str
    """A folder, local or a URI."""
    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    text_field: str = "text"
    id_field: str | None = None
    rows_per_file: int = 10_000
    """Rows of one input file per output file (a shard: the unit of work and of resuming)."""
    chunk_size: int = 512
    """Rows per engine call inside a shard."""
    truncate_prompt_tokens: int | None = -1
    dimensions: int | None = None
    overwrite: bool = False
    progress: bool = True
    num_actors: int | None = None
    """Engines; default: the cluster's CPUs / cpus_per_actor (at most one per shard)."""
    cpus_per_actor: float = 1.0
    """CPUs each actor reserves; its engine runs as many threads."""

    def settings(self, input_uri: str) -> dict[str, Any]:
        """What decides the output's rows: a rerun with other values must not mix with it."""
        return {
            "input": input_uri,
            "model": self.model,
            "dtype": str(self.engine_kwargs.get("dtype", "auto")),
            "text_field": self.text_field,
            "id_field": self.id_field,
            "rows_per_file": self.rows_per_file,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "dimensions": self.dimensions,
        }


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_stop) of one input file; for .jsonl / .txt also their byte range."""

    path: str
    source: str
    kind: str
    row_start: int
    row_stop: int
    name: str
    byte_start: int = 0
    byte_stop: int = 0


@dataclass(frozen=True)
class JobSummary:
    num_shards: int
    num_skipped: int
    num_rows: int
    """Rows written by this run."""
    num_errors: int
    """Rows of this run with an error instead of an embedding."""


# ---------------------------------------------------------------------- filesystems


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) for a local path or a URI pyarrow knows."""
    import pyarrow.fs as pafs

    if "://" not in uri:
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    return pafs.FileSystem.from_uri(uri)


def _canonical_uri(uri: str) -> str:
    return uri if "://" in uri else str(Path(uri).expanduser().resolve())


def list_inputs(fs: pafs.FileSystem, path: str) -> list[tuple[str, str]]:
    """(path, name relative to INPUT) of every input file, sorted; `_` / `.` entries skipped."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise JobError(f"no input file or folder {path}")
    if info.type == pafs.FileType.File:
        _input_kind(path)
        return [(path, posixpath.basename(path))]
    found = []
    for entry in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        relative = entry.path[len(path) :].lstrip("/")
        hidden = any(part.startswith(("_", ".")) for part in relative.split("/"))
        if entry.type == pafs.FileType.File and not hidden and _suffix(relative) in INPUT_SUFFIXES:
            found.append((entry.path, relative))
    if not found:
        raise JobError(f"{path} holds no {', '.join(INPUT_SUFFIXES)} files")
    return sorted(found)


def _suffix(path: str) -> str:
    return posixpath.splitext(path)[1].lower()


def _input_kind(path: str) -> str:
    suffix = _suffix(path)
    if suffix not in INPUT_SUFFIXES:
        raise JobError(f"input {path} has an unknown format {suffix!r}; use {INPUT_SUFFIXES}")
    return suffix[1:]


# ---------------------------------------------------------------------- planning


def shard_name(source: str, row_start: int) -> str:
    """`<stem>-<hash8>-<row_start>.parquet`: stable across runs, distinct for every input."""
    stem = posixpath.splitext(posixpath.basename(source))[0]
    digest = hashlib.sha1(source.encode("utf-8")).hexdigest()[:8]
    return f"{stem}-{digest}-{row_start:012d}.parquet"


@dataclass(frozen=True)
class JobPlan:
    input_fs: pafs.FileSystem
    output_fs: pafs.FileSystem
    output_path: str
    shards: list[Shard]
    id_type: pa.DataType | None
    """One type for the `id` column of every output file (readers need one schema): the parquet
    inputs' type when they all agree and there is no .jsonl / .txt input, else string."""


def plan_job(job: RayEmbedJob) -> JobPlan:
    input_fs, input_path = resolve(job.input)
    output_fs, output_path = resolve(job.output)
    shards: list[Shard] = []
    id_types = set()
    for path, source in list_inputs(input_fs, input_path):
        kind = _input_kind(path)
        if kind == "parquet":
            num_rows, id_type = _parquet_footer(input_fs, path, job)
            ranges = [(a, b, 0, 0) for a, b in _row_ranges(num_rows, job)]
        else:
            with input_fs.open_input_stream(path) as stream:
                ranges = line_ranges(stream, job.rows_per_file)
            id_type = "string"
        id_types.add(id_type)
        for row_start, row_stop, byte_start, byte_stop in ranges:
            name = shard_name(source, row_start)
            shards.append(
                Shard(path, source, kind, row_start, row_stop, name, byte_start, byte_stop)
            )
    return JobPlan(input_fs, output_fs, output_path, shards, _one_id_type(job, id_types))


def _one_id_type(job: RayEmbedJob, id_types: set[Any]) -> pa.DataType | None:
    import pyarrow as pa

    if not job.id_field:
        return None
    if len(id_types) == 1 and (only := next(iter(id_types))) != "string":
        return only
    return pa.string()


def _parquet_footer(fs: pafs.FileSystem, path: str, job: RayEmbedJob) -> tuple[int, Any]:
    """(rows, id column type) from the footer; the text and id columns must be there."""
    import pyarrow.parquet as pq

    with fs.open_input_file(path) as f:
        file = pq.ParquetFile(f)
        schema = file.schema_arrow
        for column in [job.text_field] + ([job.id_field] if job.id_field else []):
            if column not in schema.names:
                raise JobError(f"{path} has no column {column!r}; columns: {schema.names}")
        id_type = schema.field(job.id_field).type if job.id_field else None
        return file.metadata.num_rows, id_type


def _row_ranges(num_rows: int, job: RayEmbedJob) -> list[tuple[int, int]]:
    return [
        (start, min(start + job.rows_per_file, num_rows))
        for start in range(0, num_rows, job.rows_per_file)
    ]


def line_ranges(stream: Any, rows_per_file: int) -> list[tuple[int, int, int, int]]:
    """(row_start, row_stop, byte_start, byte_stop) per shard; a row is a non-blank line.

    Example, rows_per_file=2, b"a\\n\\nb\\nc\\n": rows a (bytes 0-1), b (3-4), c (5-6) →
    [(0, 2, 0, 5), (2, 3, 5, 7)]: the blank line stays inside the first shard's bytes.
    """
    planner = _LinePlanner(rows_per_file)
    tail = b""
    while block := stream.read(_READ_BLOCK_BYTES):
        lines = (tail + block).split(b"\n")
        tail = lines.pop()  # an unfinished line (b"" when the block ends with a newline)
        for line in lines:
            planner.add(line, len(line) + 1)
    if tail:
        planner.add(tail, len(tail))
    return planner.finish()


class _LinePlanner:
    def __init__(self, rows_per_file: int) -> None:
        self.rows_per_file = rows_per_file
        self.ranges: list[tuple[int, int, int, int]] = []
        self.num_rows = self.num_bytes = self.shard_row = self.shard_byte = 0

    def add(self, line: bytes, num_bytes: int) -> None:
        if line.strip():
            if self.num_rows - self.shard_row == self.rows_per_file:
                self._close_shard()
            self.num_rows += 1
        self.num_bytes += num_bytes

    def _close_shard(self) -> None:
        self.ranges.append((self.shard_row, self.num_rows, self.shard_byte, self.num_bytes))
        self.shard_row, self.shard_byte = self.num_rows, self.num_bytes

    def finish(self) -> list[tuple[int, int, int, int]]:
        if self.num_rows > self.shard_row:
            self._close_shard()
        return self.ranges


# ---------------------------------------------------------------------- reading one shard


@dataclass
class ShardRows:
    texts: list[Any]
    ids: list[Any]
    read_errors: list[str | None]
    """Rows that could not be read (not JSON, no text field): reported, not embedded."""


def read_shard(
    fs: pafs.FileSystem, shard: Shard, text_field: str, id_field: str | None
) -> ShardRows:
    if shard.kind == "parquet":
        return _read_parquet_rows(fs, shard, text_field, id_field)
    with fs.open_input_file(shard.path) as f:
        f.seek(shard.byte_start)
        data = f.read(shard.byte_stop - shard.byte_start)
    rows = ShardRows([], [], [])
    for line in data.split(b"\n"):
        if line.strip():
            text, row_id, error = _parse_line(line, shard.kind, text_field, id_field)
            rows.texts.append(text)
            rows.ids.append(row_id)
            rows.read_errors.append(error)
    if len(rows.texts) != shard.row_stop - shard.row_start:
        raise JobError(f"{shard.path} changed since the job was planned; rerun it")
    return rows


def _parse_line(
    line: bytes, kind: str, text_field: str, id_field: str | None
) -> tuple[Any, Any, str | None]:
    try:
        decoded = line.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as e:
        return None, None, f"not valid UTF-8 ({e})"
    if kind == "txt":
        return decoded, None, None
    try:
        value = json.loads(decoded)
    except json.JSONDecodeError as e:
        return None, None, f"not valid JSON ({e})"
    if isinstance(value, str):
        return value, None, None
    if not isinstance(value, dict) or text_field not in value:
        return None, None, f"expected an object with a {text_field!r} field or a string"
    return value[text_field], value.get(id_field) if id_field else None, None


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
    return ShardRows(texts, ids, [None] * len(texts))


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
        _write_json(self.output_fs, f"{self.output}/{DONE_DIR}/{shard.name}.json", marker)
        return shard.name, table.num_rows, num_errors

    def _embed(self, rows: ShardRows) -> PooledRows:
        """Embed the readable rows chunk by chunk; unreadable ones keep their read error."""
        readable = [i for i, error in enumerate(rows.read_errors) if error is None]
        errors = list(rows.read_errors)
        parts = []
        for start in range(0, len(readable), self.job.chunk_size):
            chunk = readable[start : start + self.job.chunk_size]
            pooled = self.predictor.pool([rows.texts[i] for i in chunk])
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

        num_rows = len(rows.texts)
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


# ---------------------------------------------------------------------- the output folder


def _read_json(fs: pafs.FileSystem, path: str) -> Any:
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode("utf-8"))


def _write_json(fs: pafs.FileSystem, path: str, value: Any) -> None:
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(value, indent=1).encode("utf-8"))


def prepare_output(
    fs: pafs.FileSystem, path: str, settings: dict[str, Any], overwrite: bool
) -> None:
    """Create OUTPUT with its manifest, or check that it holds this job's output."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise JobError(f"the output {path} is a file; --ray writes a folder of parquet files")
    if overwrite and info.type == pafs.FileType.Directory:
        fs.delete_dir_contents(path)
    fs.create_dir(path, recursive=True)
    manifest = _read_json(fs, f"{path}/{MANIFEST}")
    if manifest is None:
        if fs.get_file_info(pafs.FileSelector(path)):
            raise JobError(
                f"{path} is not empty and holds no {MANIFEST}: not a tidepool job's output "
                "(pass --overwrite to empty it)"
            )
        _write_json(fs, f"{path}/{MANIFEST}", settings)
        return
    changed = sorted(
        k for k in settings.keys() | manifest.keys() if settings.get(k) != manifest.get(k)
    )
    if changed:
        details = ", ".join(f"{k}: {manifest.get(k)!r} → {settings.get(k)!r}" for k in changed)
        raise JobError(
            f"{path} holds the output of a job with other settings ({details}); "
            "pass --overwrite to start again, or choose another output"
        )


def completed_shards(fs: pafs.FileSystem, path: str) -> set[str]:
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(f"{path}/{DONE_DIR}", allow_not_found=True)
    return {
        posixpath.basename(info.path).removesuffix(".json")
        for info in fs.get_file_info(selector)
        if info.path.endswith(".json")
    }


# ---------------------------------------------------------------------- the job


def run_ray_embed_job(job: RayEmbedJob, address: str | None = None) -> JobSummary:
    """Plan the shards, skip the complete ones, embed the rest on Ray.

    Ray is joined at `address` (see `connect`) only when there is work left, and left again
    afterwards; with None, the caller has called `ray.init` already.
    """
    import pyarrow.fs as pafs

    plan = plan_job(job)
    output_fs, output_path = plan.output_fs, plan.output_path
    prepare_output(output_fs, output_path, job.settings(_canonical_uri(job.input)), job.overwrite)
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
    _write_json(output_fs, f"{output_path}/{SUCCESS}", {"num_shards": num_shards})
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


def cmd_embed_ray(args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any]) -> int:
    """`tidepool embed --ray ADDRESS ...` (the CLI's flags, already parsed)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        print("error: --ray needs Ray: pip install 'tidepool[ray]'", file=sys.stderr)
        return 2
    from tidepool.entrypoints.llm import build_engine_config

    # A missing model or engine arguments that do not fit fail here, in one line (the CLI's
    # exit status 2), not in every actor after the cluster has started.
    build_engine_config(model, **engine_kwargs)
    job = RayEmbedJob(
        input=str(args.input),
        output=str(args.output),
        model=model,
        engine_kwargs=engine_kwargs,
        text_field=args.text_field,
        id_field=args.id_field,
        rows_per_file=args.rows_per_file,
        chunk_size=args.chunk_size,
        truncate_prompt_tokens=None if args.no_truncate else args.truncate_prompt_tokens,
        dimensions=args.dimensions,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        num_actors=args.num_actors,
        cpus_per_actor=args.cpus_per_actor,
    )
    try:
        summary = run_ray_embed_job(job, args.ray)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConnectionError as e:  # no cluster at that address
        print(f"error: cannot join the Ray cluster at {args.ray!r}: {e}", file=sys.stderr)
        return 2
    print(
        f"embedded {summary.num_rows} rows into {summary.num_shards - summary.num_skipped} files "
        f"of {args.output} ({summary.num_skipped} were complete already)"
    )
    if summary.num_errors:
        print(f"{summary.num_errors} rows have no embedding: see their `error` column")
    return 0
