"""`tidepool embed`: every input and output format, resuming after a crash, the demo, errors.

The CLI runs in-process (`main([...])`) with `tidepool.LLM` patched to hand out one shared engine,
so the model loads once; one test runs the real console entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tidepool
from tidepool.entrypoints.cli import main
from tidepool.jobs import local as batch_embed

NUM_ROWS = 37  # not a multiple of the chunk size: the last chunk is short
CHUNK = ["--chunk-size", "8", "--no-progress"]


def _texts() -> list[str]:
    return [f"row {i}: " + "tidepool embeds text " * (i % 7 + 1) for i in range(NUM_ROWS)]


@pytest.fixture(scope="module")
def shared_llm():
    return tidepool.LLM()


@pytest.fixture(autouse=True)
def one_engine(monkeypatch, shared_llm) -> None:
    monkeypatch.setattr(tidepool, "LLM", lambda *args, **kwargs: shared_llm)


@pytest.fixture(scope="module")
def expected(shared_llm) -> np.ndarray:
    outs = shared_llm.embed(_texts(), use_tqdm=False)
    return np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)


def write_input(folder: Path, suffix: str) -> Path:
    path = folder / f"input{suffix}"
    texts = _texts()
    if suffix == ".txt":
        path.write_text("\n".join(texts) + "\n\n")  # a trailing blank line is skipped
    elif suffix == ".jsonl":
        path.write_text(
            "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts))
        )
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": texts}), path)
    return path


def read_output(path: Path) -> tuple[np.ndarray, list]:
    if path.suffix == ".npy":
        return np.load(path), []
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["index"] for r in rows] == list(range(len(rows)))
        return np.asarray([r["embedding"] for r in rows], dtype=np.float32), [
            r.get("id") for r in rows
        ]
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pydict()
    assert table["index"] == list(range(len(table["index"])))
    return np.asarray(table["embedding"], dtype=np.float32), table.get("id", [])


def assert_embeddings(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    cos = (
        (actual * expected).sum(axis=1)
        / np.linalg.norm(actual, axis=1)
        / np.linalg.norm(expected, axis=1)
    )
    assert cos.min() >= 0.99999


@pytest.mark.parametrize("in_suffix", [".txt", ".jsonl", ".parquet"])
@pytest.mark.parametrize("out_suffix", [".jsonl", ".npy", ".parquet"])
def test_embed_formats(tmp_path: Path, expected, in_suffix: str, out_suffix: str) -> None:
    src = write_input(tmp_path, in_suffix)
    out = tmp_path / f"out{out_suffix}"
    id_args = [] if in_suffix == ".txt" else ["--id-field", "id"]
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK, *id_args]) == 0
    embeddings, ids = read_output(out)
    assert_embeddings(embeddings, expected)
    if in_suffix != ".txt" and out_suffix != ".npy":
        assert ids == [f"r{i}" for i in range(NUM_ROWS)]
    # No leftovers: the output and its manifest (what a rerun checks before resuming).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [src.name, out.name, out.name + ".manifest.json"]
    )


@pytest.mark.parametrize("out_suffix", [".jsonl", ".npy", ".parquet"])
def test_resume_after_a_crash(
    tmp_path: Path, expected, monkeypatch, capsys, out_suffix: str
) -> None:
    src = write_input(tmp_path, ".jsonl")
    out = tmp_path / f"out{out_suffix}"
    real_embed_chunk = batch_embed.embed_chunk
    calls = {"n": 0}

    def crash_on_third_chunk(llm, rows, job):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed mid-job
        return real_embed_chunk(llm, rows, job)

    monkeypatch.setattr(batch_embed, "embed_chunk", crash_on_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        main(["embed", "-i", str(src), "-o", str(out), *CHUNK])
    if out_suffix == ".jsonl":
        with out.open("a") as f:
            f.write('{"index": 16, "embed')  # a torn line from a write cut short
    monkeypatch.setattr(batch_embed, "embed_chunk", real_embed_chunk)
    calls["n"] = 0
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK]) == 0
    assert "resuming: 16 of 37 rows" in capsys.readouterr().out
    assert_embeddings(read_output(out)[0], expected)
    # A rerun of a finished job embeds nothing.
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK]) == 0
    assert "embedded 0 rows" in capsys.readouterr().out


def test_resume_skips_rows_already_written(tmp_path: Path, monkeypatch) -> None:
    src = write_input(tmp_path, ".txt")
    out = tmp_path / "out.jsonl"
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK]) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:20]))
    embedded: list[int] = []
    real_embed_chunk = batch_embed.embed_chunk

    def spy(llm, rows, job):
        embedded.extend(r.index for r in rows)
        return real_embed_chunk(llm, rows, job)

    monkeypatch.setattr(batch_embed, "embed_chunk", spy)
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK]) == 0
    assert embedded == list(range(20, NUM_ROWS))
    assert out.read_text().splitlines(keepends=True)[:20] == lines[:20]


def test_bad_rows_and_files_give_clear_errors(tmp_path: Path, capsys) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"text": ""}\n')
    assert main(["embed", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]) == 1
    assert "row 1: the text must be a non-empty string" in capsys.readouterr().err
    src.write_text('{"body": "no text field"}\n')
    assert main(["embed", "-i", str(src), "-o", str(tmp_path / "p.jsonl"), "--no-progress"]) == 1
    assert "'text' field" in capsys.readouterr().err
    assert main(["embed", "-i", str(src), "-o", str(tmp_path / "o.csv")]) == 1
    assert "unknown format '.csv'" in capsys.readouterr().err
    assert main(["embed", "-i", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "o.npy")]) == 1
    assert capsys.readouterr().err == f"error: no input file {tmp_path / 'missing.txt'}\n"


def test_missing_pyarrow_is_explained(tmp_path: Path, monkeypatch, capsys) -> None:
    src = write_input(tmp_path, ".txt")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert main(["embed", "-i", str(src), "-o", str(tmp_path / "o.parquet"), *CHUNK]) == 1
    assert "pip install 'tidepool[parquet]'" in capsys.readouterr().err


def test_demo_in_process(capsys) -> None:
    assert main(["embed", "--demo", "--num-demo-texts", "40"]) == 0
    out = capsys.readouterr().out
    assert "texts/s" in out and "tokens/s" in out and "dim=384" in out


def test_demo_console_entry_point(tmp_path: Path) -> None:
    # What `make demo` runs: the real entry point, the bundled model, offline.
    result = subprocess.run(
        [sys.executable, "-m", "tidepool.entrypoints.cli", "embed", "--demo", "--num-demo-texts", "50"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "texts/s" in result.stdout and "tokens/s" in result.stdout


def test_startup_errors_print_one_line(monkeypatch, capsys) -> None:
    def missing_model(*args, **kwargs):
        raise FileNotFoundError("model '/nowhere' not found; tidepool never downloads")

    monkeypatch.setattr(tidepool, "LLM", missing_model)
    assert main(["embed", "/nowhere", "--demo"]) == 2
    assert (
        capsys.readouterr().err == "error: model '/nowhere' not found; tidepool never downloads\n"
    )


@pytest.mark.parametrize("what", ["output folder", "missing folder", "input folder", "dev null"])
def test_paths_that_cannot_work_are_one_line(tmp_path: Path, capsys, what: str) -> None:
    """Refused before the model loads, in one line naming the problem (issue 26: tracebacks,
    and "no input file" for a folder or /dev/null)."""
    src, out = write_input(tmp_path, ".txt"), tmp_path / "out.npy"
    expected = {
        "output folder": "is a folder: give a file (.jsonl, .parquet or .npy)",
        "missing folder": "the output's folder",
        "input folder": "is a folder: give a file (.txt, .jsonl or .parquet)",
        "dev null": "is not a regular file (a device, pipe or socket)",
    }[what]
    if what == "output folder":
        out.mkdir()
    elif what == "missing folder":
        out = tmp_path / "nowhere" / "out.npy"
    elif what == "input folder":
        src = tmp_path
    else:
        src = Path("/dev/null")
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody may write to: chmod for a user, the immutable flag for root (whom
    permissions do not stop); skipped where neither holds."""
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "out.jsonl").write_text("")
    if os.geteuid() == 0:
        if (
            shutil.which("chattr") is None
            or subprocess.run(["chattr", "+i", str(folder)]).returncode
        ):
            pytest.skip("root, and no chattr +i here: nothing is read-only for root")
        undo = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        undo = ["chmod", "755", str(folder)]
    try:
        (folder / "probe").touch()
    except OSError:
        pass
    else:
        subprocess.run(undo)
        pytest.skip("the folder stays writable here")
    yield folder
    subprocess.run(undo, check=True)


@pytest.mark.parametrize("name", ["out.jsonl", "new.npy"])
def test_read_only_output_is_one_line(tmp_path: Path, read_only_folder: Path, capsys, name) -> None:
    src, out = write_input(tmp_path, ".txt"), read_only_folder / name
    assert main(["embed", "-i", str(src), "-o", str(out), *CHUNK]) == 1
    err = capsys.readouterr().err
    assert err == f"error: the output {out} cannot be written here: permission denied\n"
