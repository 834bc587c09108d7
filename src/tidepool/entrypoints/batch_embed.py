"""`tidepool embed`: embed a file of texts in chunks, resumably; and the offline demo.

Inputs: .txt (one text per non-blank line), .jsonl (objects with a text field, or JSON strings),
.parquet (a text column). Outputs: .jsonl, .parquet or .npy, written one chunk at a time.

Resuming: progress is the number of rows already in the output. A rerun counts them and starts
at the next row, so a killed job loses at most the chunk it was computing:

    .jsonl    complete lines (a torn last line is cut off)
    .npy      a float32 memmap of [num_rows, dim] + OUTPUT.progress holding the row count
    .parquet  one part file per chunk in OUTPUT.parts/ (renamed into place when complete);
              merged into OUTPUT when the job ends
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

INPUT_FORMATS = (".txt", ".jsonl", ".parquet")
OUTPUT_FORMATS = (".jsonl", ".parquet", ".npy")


class JobError(Exception):
    """A problem the user must fix (bad file, wrong format); printed without a traceback."""


@dataclass(frozen=True)
class Row:
    index: int
    text: Any
    row_id: Any = None


# ---------------------------------------------------------------------- input


def _require_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise JobError(
            "parquet needs pyarrow, which is not installed: pip install 'tidepool[parquet]' "
            "(or pip install pyarrow)"
        ) from e
    return pq


def _check_suffix(path: Path, allowed: tuple[str, ...], what: str) -> str:
    suffix = path.suffix.lower()
    if suffix not in allowed:
        raise JobError(f"{what} {path} has an unknown format {suffix!r}; use {', '.join(allowed)}")
    return suffix


def count_rows(path: Path) -> int:
    suffix = _check_suffix(path, INPUT_FORMATS, "input")
    if suffix == ".parquet":
        return _require_pyarrow().ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def iter_rows(path: Path, text_field: str, id_field: str | None, start: int) -> Iterator[Row]:
    """The input's rows from row `start` on (rows before it are skipped without parsing)."""
    suffix = _check_suffix(path, INPUT_FORMATS, "input")
    if suffix == ".parquet":
        yield from _iter_parquet(path, text_field, id_field, start)
        return
    with path.open(encoding="utf-8") as f:
        lines = (line for line in f if line.strip())
        for index, line in enumerate(lines):
            if index < start:
                continue
            if suffix == ".txt":
                yield Row(index, line.rstrip("\r\n"))
            else:
                yield _jsonl_row(index, line, text_field, id_field)


def _jsonl_row(index: int, line: str, text_field: str, id_field: str | None) -> Row:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise JobError(f"row {index}: not valid JSON ({e})") from e
    if isinstance(value, str):
        return Row(index, value)
    if not isinstance(value, dict) or text_field not in value:
        raise JobError(f"row {index}: expected an object with a {text_field!r} field or a string")
    return Row(index, value[text_field], value.get(id_field) if id_field else None)


def _iter_parquet(path: Path, text_field: str, id_field: str | None, start: int) -> Iterator[Row]:
    pq = _require_pyarrow()
    file = pq.ParquetFile(path)
    columns = [text_field] + ([id_field] if id_field else [])
    missing = [c for c in columns if c not in file.schema_arrow.names]
    if missing:
        raise JobError(f"{path} has no column {missing[0]!r}; columns: {file.schema_arrow.names}")
    index = 0
    for batch in file.iter_batches(columns=columns, batch_size=4096):
        if index + batch.num_rows <= start:
            index += batch.num_rows
            continue
        texts = batch.column(text_field).to_pylist()
        ids = batch.column(id_field).to_pylist() if id_field else [None] * len(texts)
        for text, row_id in zip(texts, ids, strict=True):
            if index >= start:
                yield Row(index, text, row_id)
            index += 1


# ---------------------------------------------------------------------- output


class Writer(Protocol):
    rows_done: int
    """Rows already in the output: the job resumes at this row."""

    def write(self, start: int, embeddings: np.ndarray, ids: list[Any]) -> None: ...

    def finish(self) -> None: ...


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows_done = self._count_complete_lines()

    def _count_complete_lines(self) -> int:
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):  # a chunk was cut off mid-line: drop the torn line
            with self.path.open("r+b") as f:
                f.truncate(complete)
        return data.count(b"\n", 0, complete)

    def write(self, start: int, embeddings: np.ndarray, ids: list[Any]) -> None:
        lines = []
        for offset, (vector, row_id) in enumerate(zip(embeddings, ids, strict=True)):
            row: dict[str, Any] = {"index": start + offset}
            if row_id is not None:
                row["id"] = row_id
            row["embedding"] = vector.tolist()
            lines.append(json.dumps(row) + "\n")
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        self.rows_done = start + len(embeddings)

    def finish(self) -> None:
        pass


class NpyWriter:
    def __init__(self, path: Path, num_rows: int) -> None:
        self.path = path
        self.num_rows = num_rows
        self.progress_path = path.with_name(path.name + ".progress")
        self.array: np.memmap | None = None
        if self.progress_path.exists():
            self.rows_done = int(self.progress_path.read_text().strip() or 0)
            self.array = np.load(path, mmap_mode="r+")
        elif path.exists():  # finished earlier (no progress file left)
            self.rows_done = int(np.load(path, mmap_mode="r").shape[0])
        else:
            self.rows_done = 0

    def write(self, start: int, embeddings: np.ndarray, ids: list[Any]) -> None:
        if self.array is None:  # the width is known once the first chunk is embedded
            self.array = np.lib.format.open_memmap(
                self.path, mode="w+", dtype=np.float32, shape=(self.num_rows, embeddings.shape[1])
            )
        self.array[start : start + len(embeddings)] = embeddings
        self.array.flush()
        self.rows_done = start + len(embeddings)
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(str(self.rows_done))
        os.replace(tmp, self.progress_path)  # atomic: the count never runs ahead of the data

    def finish(self) -> None:
        self.array = None
        self.progress_path.unlink(missing_ok=True)


class ParquetWriter:
    def __init__(self, path: Path) -> None:
        self.pq = _require_pyarrow()
        self.path = path
        self.parts_dir = path.with_name(path.name + ".parts")
        if self.parts_dir.exists():
            self.rows_done = sum(self.pq.read_metadata(part).num_rows for part in self._parts())
        elif path.exists():
            self.rows_done = self.pq.read_metadata(path).num_rows
        else:
            self.rows_done = 0

    def _parts(self) -> list[Path]:
        return sorted(self.parts_dir.glob("part-*.parquet"))

    def write(self, start: int, embeddings: np.ndarray, ids: list[Any]) -> None:
        import pyarrow as pa

        self.parts_dir.mkdir(parents=True, exist_ok=True)
        columns: dict[str, Any] = {"index": pa.array(range(start, start + len(embeddings)))}
        if any(i is not None for i in ids):
            columns["id"] = pa.array(ids)
        flat = pa.array(embeddings.reshape(-1), type=pa.float32())
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, embeddings.shape[1])
        part = self.parts_dir / f"part-{start:012d}.parquet"
        tmp = part.with_suffix(".tmp")
        self.pq.write_table(pa.table(columns), tmp)
        os.replace(tmp, part)
        self.rows_done = start + len(embeddings)

    def finish(self) -> None:
        if not self.parts_dir.exists():
            return
        parts = self._parts()
        tmp = self.path.with_name(self.path.name + ".tmp")
        writer = None
        for part in parts:
            table = self.pq.read_table(part)
            if writer is None:
                writer = self.pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
        if writer is not None:
            writer.close()
            os.replace(tmp, self.path)
        shutil.rmtree(self.parts_dir)


def open_writer(path: Path, num_rows: int, overwrite: bool) -> Writer:
    suffix = _check_suffix(path, OUTPUT_FORMATS, "output")
    if overwrite:
        for leftover in (path, path.with_name(path.name + ".progress")):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(path.name + ".parts"), ignore_errors=True)
    if suffix == ".jsonl":
        return JsonlWriter(path)
    if suffix == ".npy":
        return NpyWriter(path, num_rows)
    return ParquetWriter(path)


# ---------------------------------------------------------------------- the job


@dataclass(frozen=True)
class EmbedJob:
    input: Path
    output: Path
    text_field: str = "text"
    id_field: str | None = None
    chunk_size: int = 512
    truncate_prompt_tokens: int | None = -1
    dimensions: int | None = None
    overwrite: bool = False
    progress: bool = True


def _chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def embed_chunk(llm: Any, rows: list[Row], job: EmbedJob) -> np.ndarray:
    """[len(rows), dim] float32. An invalid row stops the job, naming the row."""
    from tidepool.outputs import BatchInputError
    from tidepool.params import PoolingParams

    for row in rows:
        if not isinstance(row.text, str) or not row.text:
            raise JobError(
                f"row {row.index}: the text must be a non-empty string, got {row.text!r}"
            )
    try:
        outputs = llm.encode(
            [row.text for row in rows],
            PoolingParams(dimensions=job.dimensions),
            pooling_task="embed",
            truncate_prompt_tokens=job.truncate_prompt_tokens,
            use_tqdm=False,
        )
    except BatchInputError as e:
        first = e.errors[0]
        raise JobError(f"row {rows[first.index].index}: {first.message}") from e
    return np.stack([o.outputs.data.float().numpy() for o in outputs]).astype(np.float32)


def run_embed_job(llm: Any, job: EmbedJob) -> int:
    """Embed every row not yet in the output; returns how many rows this run embedded."""
    from tqdm.auto import tqdm

    num_rows = count_rows(job.input)
    writer = open_writer(job.output, num_rows, job.overwrite)
    if writer.rows_done > num_rows:
        raise JobError(
            f"{job.output} already has {writer.rows_done} rows but {job.input} has {num_rows}: "
            "is it the output of another input? pass --overwrite to start again"
        )
    start = writer.rows_done
    if start:
        print(f"resuming: {start} of {num_rows} rows are already in {job.output}")
    bar = tqdm(total=num_rows, initial=start, unit="row", disable=not job.progress)
    try:
        rows = iter_rows(job.input, job.text_field, job.id_field, start)
        for chunk in _chunks(rows, job.chunk_size):
            embeddings = embed_chunk(llm, chunk, job)
            writer.write(chunk[0].index, embeddings, [row.row_id for row in chunk])
            bar.update(len(chunk))
    finally:
        bar.close()
    writer.finish()
    return num_rows - start


# ---------------------------------------------------------------------- demo

_SUBJECTS = [
    "The engine",
    "A small model",
    "Our server",
    "The scheduler",
    "Every request",
    "The cat",
    "A sailor",
    "The market",
    "My neighbour",
    "The river",
    "A student",
    "The old library",
]
_VERBS = [
    "computes",
    "batches",
    "embeds",
    "ranks",
    "reads",
    "watches",
    "crosses",
    "sells",
    "finds",
    "explains",
    "carries",
    "remembers",
]
_OBJECTS = [
    "sentences of every length",
    "the morning tide",
    "thousands of documents",
    "a quiet song",
    "fresh bread and cheese",
    "the shortest path home",
    "vectors on the CPU",
    "stormy weather",
    "a forgotten letter",
    "the latest search results",
    "tokens without padding",
    "stories about the sea",
]
_TAILS = [
    "",
    " before noon",
    " with great care",
    " in one step",
    " every single day",
    " for a friend",
    " under the bright moon",
    " faster than expected",
]


def demo_corpus(num_texts: int = 300, seed: int = 0) -> list[str]:
    """Generated sentences (fixed seed): varied, offline, no data set needed."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
        for _ in range(num_texts)
    ]


def run_demo(llm: Any, num_texts: int = 300) -> None:
    texts = demo_corpus(num_texts)
    llm.embed(texts[:8], use_tqdm=False)  # warm-up: first-call allocations are not throughput
    start = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=True)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"model: {llm.model_config.model}")
    print(
        f"embedded {len(texts)} texts ({num_tokens} tokens) in {seconds:.2f} s: "
        f"{len(texts) / seconds:.1f} texts/s, {num_tokens / seconds:.0f} tokens/s"
    )
    for text, out in list(zip(texts, outputs, strict=True))[:2]:
        values = ", ".join(f"{v:+.4f}" for v in out.outputs.embedding[:6])
        print(f"  {text!r:60} dim={len(out.outputs.embedding)} [{values}, ...]")
