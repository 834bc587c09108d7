"""`tidepool embed --ray` planning: the input files' shards, the output folder, resuming.

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
left no marker and the shard is written again. Rows and lines are those of `tidepool.jobs.rows`
(the local job's rule: blank lines are not rows).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from tidepool.jobs.formats import JobError, parquet_columns
from tidepool.jobs.manifest import (
    MANIFEST_VERSION,
    differences,
    model_fields,
    prefix_fingerprint,
    refuse_other_job,
)
from tidepool.jobs.rows import is_blank, iter_lines

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

INPUT_SUFFIXES = (".parquet", ".jsonl", ".txt")
MANIFEST = "_tidepool_job.json"
DONE_DIR = "_done"
TMP_DIR = "_tmp"
SUCCESS = "_SUCCESS"


@dataclass(frozen=True)
class RayEmbedJob:
    """The settings of one `tidepool embed --ray` job (the CLI's flags)."""

    input: str
    """A file or folder, local or a URI."""
    output: str
    """A folder, local or a URI."""
    model: str
    """The model every actor loads."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """`LLM`'s other arguments (dtype, max_num_seqs, ...)."""
    text_field: str = "text"
    """The .jsonl key / parquet column of the texts."""
    id_field: str | None = None
    """A .jsonl key / parquet column copied to the output as `id`."""
    rows_per_file: int = 10_000
    """Rows of one input file per output file (a shard: the unit of work and of resuming)."""
    chunk_size: int = 512
    """Rows per engine call inside a shard."""
    truncate_prompt_tokens: int | None = -1
    """Keep the first N tokens; -1: the model's maximum; None: a longer row is a bad row."""
    dimensions: int | None = None
    """Matryoshka truncation."""
    overwrite: bool = False
    """Empty OUTPUT first instead of resuming."""
    progress: bool = True
    """Ray's progress display."""
    num_actors: int | None = None
    """Engines; default: the cluster's CPUs / cpus_per_actor (at most one per shard)."""
    cpus_per_actor: float = 1.0
    """CPUs each actor reserves; its engine runs as many threads."""

    def settings(self, input_uri: str, plan: JobPlan | None = None) -> dict[str, Any]:
        """What decides the output's rows (jobs/manifest.py): a rerun with other values must not
        mix with it. With the plan: the model's fingerprint and resolved settings, and each
        input file's size and first bytes, too."""
        settings: dict[str, Any] = {
            "manifest_version": MANIFEST_VERSION,
            "input": input_uri,
            "model": self.model,
            "dtype": str(self.engine_kwargs.get("dtype", "auto")),
            "engine_kwargs": json.loads(json.dumps(self.engine_kwargs, default=str)),
            "task": "embed",
            "text_field": self.text_field,
            "id_field": self.id_field,
            "rows_per_file": self.rows_per_file,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "dimensions": self.dimensions,
            "output_format": ".parquet",
        }
        if plan is not None:
            from tidepool.engine.args import build_engine_config

            model = build_engine_config(self.model, **self.engine_kwargs).model
            settings.update({k: v for k, v in model_fields(model).items() if k != "model"})
            settings["input_files"] = _input_fingerprints(plan)
        return settings


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
    line_start: int = 1
    """The line number of the shard's first line (.jsonl / .txt)."""


# ---------------------------------------------------------------------- filesystems


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) for a local path or a URI pyarrow knows."""
    import pyarrow.fs as pafs

    if "://" not in uri:
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    return pafs.FileSystem.from_uri(uri)


def canonical_uri(uri: str) -> str:
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
            ranges = [(a, b, 0, 0, 1) for a, b in _row_ranges(num_rows, job)]
        else:
            with input_fs.open_input_stream(path) as stream:
                ranges = line_ranges(stream, job.rows_per_file)
            id_type = "string"
        id_types.add(id_type)
        for row_start, row_stop, byte_start, byte_stop, line_start in ranges:
            name = shard_name(source, row_start)
            shards.append(
                Shard(
                    path, source, kind, row_start, row_stop, name, byte_start, byte_stop, line_start
                )
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
        parquet_columns(file, path, job.text_field, job.id_field)
        id_type = file.schema_arrow.field(job.id_field).type if job.id_field else None
        return file.metadata.num_rows, id_type


def _row_ranges(num_rows: int, job: RayEmbedJob) -> list[tuple[int, int]]:
    return [
        (start, min(start + job.rows_per_file, num_rows))
        for start in range(0, num_rows, job.rows_per_file)
    ]


def line_ranges(stream: BinaryIO, rows_per_file: int) -> list[tuple[int, int, int, int, int]]:
    """(row_start, row_stop, byte_start, byte_stop, line_start) per shard, by the row rule of
    `tidepool.jobs.rows` (a blank line is not a row).

    Example, rows_per_file=2, b"a\\n\\nb\\nc\\n": rows a (line 1, bytes 0-1), b (line 3, 3-4),
    c (line 4, 5-6) → [(0, 2, 0, 5, 1), (2, 3, 5, 7, 4)]: the blank line stays inside the first
    shard's bytes.
    """
    ranges: list[tuple[int, int, int, int, int]] = []
    num_rows = shard_row = shard_byte = num_bytes = 0
    shard_line = 1
    for line in iter_lines(stream):
        num_bytes = line.stop
        if is_blank(line.content):
            continue
        if num_rows - shard_row == rows_per_file:
            ranges.append((shard_row, num_rows, shard_byte, line.start, shard_line))
            shard_row, shard_byte, shard_line = num_rows, line.start, line.number
        num_rows += 1
    if num_rows > shard_row:
        ranges.append((shard_row, num_rows, shard_byte, num_bytes, shard_line))
    return ranges


# ---------------------------------------------------------------------- the output folder


def _read_json(fs: pafs.FileSystem, path: str) -> Any:
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode("utf-8"))


def write_json(fs: pafs.FileSystem, path: str, value: Any) -> None:
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(value, indent=1).encode("utf-8"))


def _input_fingerprints(plan: JobPlan) -> dict[str, Any]:
    """Per input file (by its name under INPUT): its size and a fingerprint of its first MiB."""
    files = {}
    for shard in plan.shards:
        if shard.source not in files:
            size = plan.input_fs.get_file_info(shard.path).size
            with plan.input_fs.open_input_stream(shard.path) as stream:
                files[shard.source] = prefix_fingerprint(stream, size)
    return files


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
        write_json(fs, f"{path}/{MANIFEST}", settings)
        return
    changed = differences(manifest, settings)
    if changed:
        raise refuse_other_job(path, changed)


def completed_shards(fs: pafs.FileSystem, path: str) -> set[str]:
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(f"{path}/{DONE_DIR}", allow_not_found=True)
    return {
        posixpath.basename(info.path).removesuffix(".json")
        for info in fs.get_file_info(selector)
        if info.path.endswith(".json")
    }
