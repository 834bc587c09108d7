"""The batch jobs' one row reader: every line rule counted, planned and read the same way; bad rows
reported with their line numbers and skipped, good rows of the same chunk kept; exit statuses.

Line rules (tidepool.jobs.rows): lines end at b"\\n" (one "\\r" before it dropped, a lone "\\r"
stays inside its line); a line of whitespace only (Unicode whitespace too) is blank and no row.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tidepool
from tidepool.entrypoints.cli import main
from tidepool.jobs.formats import count_rows, iter_rows
from tidepool.jobs.plan import line_ranges
from tidepool.jobs.ray_runner import read_shard
from tidepool.jobs.rows import BadRow, Row

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# (raw line, what it is in a .jsonl file): "blank" (no row), "good:<text>", or "bad:<reason start>".
JSONL_CASES = [
    (b'{"text": "first"}', "good:first"),
    (b"", "blank"),
    (b"   \t ", "blank"),
    ("\u00a0\u3000 \u2003".encode(), "blank"),  # Unicode whitespace only
    (b'{"text": "crlf"}\r', "good:crlf"),  # a CRLF line ending
    (b'{"text": "a"}\r{"text": "b"}', "bad:not valid JSON"),  # a lone \r does not break lines
    (b'{"text": "lone \\r inside"}', "good:lone \r inside"),
    (b"{not json", "bad:not valid JSON"),
    (b'{"body": "no text field"}', "bad:expected an object with a 'text' field"),
    (b'{"text": 7}', "bad:the text must be a non-empty string, got 7"),
    (b'{"text": null}', "bad:the text must be a non-empty string, got None"),
    (b'{"text": ""}', "bad:the text must be a non-empty string, got ''"),
    (b'{"text": " \\u3000 "}', "bad:the text must be a non-empty string"),  # whitespace text
    (b'{"text": "\\ud800"}', "bad:the text is not valid Unicode"),  # a lone surrogate
    (b"\xff\xfe", "bad:not valid UTF-8"),
    (b'"a JSON string"', "good:a JSON string"),
    ('{"text": "line sep \u2028 inside"}'.encode(), "good:line sep \u2028 inside"),
    (b'{"text": "last, no newline"}', "good:last, no newline"),
]


def _jsonl(cases=JSONL_CASES) -> bytes:
    return b"\n".join(raw for raw, _ in cases)


def _expected_rows(cases=JSONL_CASES) -> list[tuple[int, int, str]]:
    """(index, line, kind) of every row: blank lines take no index."""
    rows = []
    for line_number, (_, kind) in enumerate(cases, start=1):
        if kind != "blank":
            rows.append((len(rows), line_number, kind))
    return rows


def test_every_line_rule_is_counted_and_read_alike(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(_jsonl())
    rows = list(iter_rows(path, "text", None, 0))
    expected = _expected_rows()
    assert count_rows(path) == len(rows) == len(expected)
    for row, (index, line, kind) in zip(rows, expected, strict=True):
        assert (row.index, row.line) == (index, line)
        if kind.startswith("good:"):
            assert isinstance(row, Row) and row.text == kind[5:]
        else:
            assert isinstance(row, BadRow) and row.error.startswith(kind[4:]), (row, kind)
            assert row.describe().startswith(f"line {line}, row {index}: ")
    # Resuming at a row skips exactly the rows before it.
    assert [r.index for r in iter_rows(path, "text", None, 5)] == [r.index for r in rows[5:]]


def test_txt_rows_keep_lone_cr_and_drop_crlf(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"one\r\ntwo\rstill two\n\xc2\xa0\n\n  three  \n\xe3\x80\x80")
    rows = list(iter_rows(path, "text", None, 0))
    assert count_rows(path) == 3
    assert [(r.index, r.line, r.text) for r in rows] == [
        (0, 1, "one"),
        (1, 2, "two\rstill two"),
        (2, 5, "  three  "),
    ]


def test_a_byte_order_mark_opening_the_file_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\xef\xbb\xbf{"text": "b"}\r\n')
    first, second = iter_rows(path, "text", None, 0)
    assert isinstance(first, Row) and first.text == "a"
    assert isinstance(second, BadRow) and second.error.startswith("not valid JSON")


_PIECES = st.sampled_from(
    [b"", b" ", b"\r", b"\xc2\xa0", "\u3000".encode(), b'{"text": "x"}', b'"s"', b"{bad", b"\xff"]
    + [b"\xef\xbb\xbf"]  # a byte-order mark: dropped where it opens the file only
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(st.lists(_PIECES, max_size=3).map(b"".join), max_size=12),
    final_newline=st.booleans(),
    rows_per_file=st.integers(1, 4),
)
def test_the_local_job_and_the_ray_shards_read_the_same_rows(
    tmp_path_factory, lines: list[bytes], final_newline: bool, rows_per_file: int
) -> None:
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.mktemp("rows") / "in.jsonl"
    path.write_bytes(data)
    local = list(iter_rows(path, "text", None, 0))
    assert count_rows(path) == len(local)
    import pyarrow.fs as pafs

    from tidepool.jobs.plan import Shard

    shards = [
        Shard(str(path), "in.jsonl", "jsonl", *r[:2], "x", *r[2:])
        for r in line_ranges(io.BytesIO(data), rows_per_file)
    ]
    from_shards = [
        row
        for shard in shards
        for row in read_shard(pafs.LocalFileSystem(), shard, "text", None).rows
    ]
    assert from_shards == local


# ---------------------------------------------------------------------- the job, end to end


@pytest.fixture
def engine(monkeypatch, tiny_llm):
    llm = tiny_llm("bert")
    monkeypatch.setattr(tidepool, "LLM", lambda *args, **kwargs: llm)
    return llm


def _reference(llm, texts: list[str]) -> np.ndarray:
    outputs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)


def _read(path: Path) -> tuple[list[int], np.ndarray]:
    """(input row of each output row, their embeddings); a .npy's NaN rows are bad rows."""
    if path.suffix == ".npy":
        array = np.load(path)
        good = ~np.isnan(array).any(axis=1) if array.shape[1] else np.zeros(len(array), bool)
        return np.flatnonzero(good).tolist(), array[good]
    if path.suffix == ".jsonl":
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        return [r["index"] for r in lines], np.asarray([r["embedding"] for r in lines], np.float32)
    table = pq.read_table(path).to_pydict()
    return table["index"], np.asarray(table["embedding"], dtype=np.float32)


@pytest.mark.parametrize("out_suffix", [".jsonl", ".npy", ".parquet"])
def test_bad_rows_are_listed_and_skipped_and_good_rows_kept(
    tmp_path: Path, engine, capsys, out_suffix: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl() + b"\n")
    out = tmp_path / f"out{out_suffix}"
    # One chunk holds good and bad rows: the good ones must still be written.
    args = ["embed", "-i", str(src), "-o", str(out), "--chunk-size", "4", "--no-progress"]
    assert main(args) == 1
    expected = _expected_rows()
    good = [(i, kind[5:]) for i, _, kind in expected if kind.startswith("good:")]
    bad = [(i, line, kind[4:]) for i, line, kind in expected if kind.startswith("bad:")]
    indexes, embeddings = _read(out)
    assert indexes == [i for i, _ in good]
    np.testing.assert_allclose(embeddings, _reference(engine, [t for _, t in good]), atol=1e-5)
    if out_suffix == ".npy":
        assert np.load(out).shape[0] == len(expected)  # row i is input row i
    reports = [json.loads(line) for line in (tmp_path / f"{out.name}.errors.jsonl").open()]
    assert [(r["index"], r["line"]) for r in reports] == [(i, line) for i, line, _ in bad]
    assert all(
        r["error"].startswith(reason) for r, (_, _, reason) in zip(reports, bad, strict=True)
    )
    err = capsys.readouterr().err
    assert f"line {bad[0][1]}, row {bad[0][0]}: not valid JSON" in err
    assert f"{len(bad)} bad rows are not in" in err
    # A rerun embeds nothing, reports each bad row once still, and still exits 1.
    assert main(args) == 1
    assert "embedded 0 rows" in capsys.readouterr().out
    assert len((tmp_path / f"{out.name}.errors.jsonl").read_text().splitlines()) == len(bad)


def test_on_error_fail_stops_at_the_first_bad_row(tmp_path: Path, engine, capsys) -> None:
    src = tmp_path / "in.jsonl"
    rows = ['{"text": "a"}', '{"text": "b"}', '{"text": "c"}', "{bad", '{"text": "d"}']
    src.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["embed", "-i", str(src), "-o", str(out), "--chunk-size", "8", "--no-progress"]
    assert main([*args, "--on-error", "fail"]) == 1
    assert "line 4, row 3: not valid JSON" in capsys.readouterr().err
    assert _read(out)[0] == [0, 1, 2]  # the rows before it are written
    # Fixed input: another input than the rows were written from (the job manifest's input
    # fingerprint), so the rerun is refused, naming --overwrite, and writes nothing ...
    src.write_text("\n".join(rows[:3] + ['{"text": "fixed"}', rows[4]]) + "\n")
    assert main([*args, "--on-error", "fail"]) != 0
    assert "--overwrite" in capsys.readouterr().err
    assert _read(out)[0] == [0, 1, 2]
    # ... and --overwrite starts again.
    assert main([*args, "--on-error", "fail", "--overwrite"]) == 0
    assert _read(out)[0] == [0, 1, 2, 3, 4]
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists()


def test_rows_the_engine_refuses_are_bad_rows_too(tmp_path: Path, engine, capsys) -> None:
    src = tmp_path / "in.txt"
    src.write_text("short\n" + "long " * 2000 + "\nalso short\n")
    out = tmp_path / "out.parquet"
    args = ["embed", "-i", str(src), "-o", str(out), "--no-truncate", "--no-progress"]
    assert main(args) == 1
    assert "line 2, row 1:" in capsys.readouterr().err
    assert _read(out)[0] == [0, 2]


def test_jobs_never_import_the_entry_points() -> None:
    """jobs/ takes an engine (or a model name for Ray's actors); the CLI above builds it."""
    import ast

    import tidepool.jobs

    for path in Path(tidepool.jobs.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith("tidepool.entrypoints"), (path.name, name)
