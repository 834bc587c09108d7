"""`tidepool embed --ray` planning, without Ray or a model: shards, names, reading, the manifest."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tidepool.jobs import plan as embed_job  # noqa: E402
from tidepool.jobs import rows as row_reader  # noqa: E402
from tidepool.jobs.formats import JobError  # noqa: E402
from tidepool.jobs.plan import (  # noqa: E402
    RayEmbedJob,
    line_ranges,
    plan_job,
    prepare_output,
    shard_name,
)
from tidepool.jobs.ray_runner import read_shard  # noqa: E402


@pytest.mark.parametrize("block_bytes", [1, 3, 1 << 24])
def test_line_ranges_skip_blank_lines_at_any_block_size(monkeypatch, block_bytes: int) -> None:
    monkeypatch.setattr(row_reader, "_READ_BLOCK_BYTES", block_bytes)
    # (row_start, row_stop, byte_start, byte_stop, line_start): line_start is the shard's
    # first line number (added when the row reader became one for both jobs).
    data = b"a\n\nb\nc\n"
    assert line_ranges(io.BytesIO(data), 2) == [(0, 2, 0, 5, 1), (2, 3, 5, 7, 4)]
    assert line_ranges(io.BytesIO(b"a\n\nb\nc"), 2) == [(0, 2, 0, 5, 1), (2, 3, 5, 6, 4)]
    assert line_ranges(io.BytesIO(b"\n \n"), 2) == []
    assert line_ranges(io.BytesIO(b"x\ny\nz\n"), 1) == [
        (0, 1, 0, 2, 1),
        (1, 2, 2, 4, 2),
        (2, 3, 4, 6, 3),
    ]


def test_shard_names_are_stable_and_distinct() -> None:
    assert shard_name("a.jsonl", 20) == shard_name("a.jsonl", 20)
    assert shard_name("a.jsonl", 20).endswith("-000000000020.parquet")
    assert shard_name("x/a.jsonl", 0) != shard_name("y/a.jsonl", 0)  # same stem, other folder


def _inputs(folder: Path) -> None:
    (folder / "sub").mkdir(parents=True)
    lines = [json.dumps({"id": i, "text": f"t{i}"}) for i in range(5)]
    lines.insert(2, "")
    lines.insert(4, "not json")
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    table = pa.table({"id": list(range(10)), "text": [f"p{i}" for i in range(10)]})
    pq.write_table(table, folder / "sub" / "b.parquet", row_group_size=3)
    (folder / "_skipped.jsonl").write_text('{"text": "hidden"}\n')
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "c.jsonl").write_text('{"text": "hidden"}\n')
    (folder / "notes.md").write_text("not an input")


def test_plan_and_read_every_row_once(tmp_path: Path) -> None:
    _inputs(tmp_path / "in")
    job = RayEmbedJob(
        str(tmp_path / "in"), str(tmp_path / "out"), "m", id_field="id", rows_per_file=4
    )
    plan = plan_job(job)
    assert [(s.source, s.row_start, s.row_stop) for s in plan.shards] == [
        ("a.jsonl", 0, 4),
        ("a.jsonl", 4, 6),
        ("sub/b.parquet", 0, 4),
        ("sub/b.parquet", 4, 8),
        ("sub/b.parquet", 8, 10),
    ]
    assert plan.id_type == pa.string()  # a .jsonl input: ids become text
    rows = [read_shard(plan.input_fs, s, "text", "id") for s in plan.shards]
    assert rows[0].texts == ["t0", "t1", "t2", None] and rows[0].ids == [0, 1, 2, None]
    assert rows[0].read_errors[3].startswith("not valid JSON")
    assert rows[1].texts == ["t3", "t4"]
    assert [t for r in rows[2:] for t in r.texts] == [f"p{i}" for i in range(10)]
    assert rows[3].ids == [4, 5, 6, 7]  # row groups of 3: the shard cuts across two


def test_parquet_only_keeps_the_id_type_and_checks_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), tmp_path / "x.parquet")
    job = RayEmbedJob(str(tmp_path / "x.parquet"), str(tmp_path / "out"), "m", id_field="id")
    assert plan_job(job).id_type == pa.int64()
    missing = RayEmbedJob(str(tmp_path / "x.parquet"), str(tmp_path / "out"), "m", text_field="t")
    with pytest.raises(JobError, match="no column 't'"):
        plan_job(missing)


def test_output_folder_belongs_to_one_job(tmp_path: Path) -> None:
    fs, path = embed_job.resolve(str(tmp_path / "out"))
    settings = {"model": "m", "rows_per_file": 10}
    prepare_output(fs, path, settings, overwrite=False)
    prepare_output(fs, path, settings, overwrite=False)  # a rerun: same settings
    with pytest.raises(JobError, match="rows_per_file: 10 → 20"):
        prepare_output(fs, path, {**settings, "rows_per_file": 20}, overwrite=False)
    prepare_output(fs, path, {**settings, "rows_per_file": 20}, overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("x")
    fs, other = embed_job.resolve(str(tmp_path / "other"))
    with pytest.raises(JobError, match="not a tidepool job's output"):
        prepare_output(fs, other, settings, overwrite=False)
