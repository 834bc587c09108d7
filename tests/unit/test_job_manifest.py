"""A job knows what it is writing (issue 26): a rerun with other settings than the output's
manifest is refused before anything is touched, for every format; a second job on the same
output is refused at once while the first goes on to a clean run's output."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tidepool.jobs import local
from tidepool.jobs.formats import JobError
from tidepool.jobs.local import EmbedJob, job_manifest, run_embed_job
from tidepool.jobs.manifest import OutputLock, differences, model_fingerprint

pytest.importorskip("pyarrow.parquet")

FORMATS = (".npy", ".jsonl", ".parquet")
NUM_ROWS = 30


def _input(folder: Path) -> Path:
    path = folder / "in.jsonl"
    rows = [{"id": f"r{i}", "text": f"row {i} " + "tide " * (i % 4)} for i in range(NUM_ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _job(folder: Path, suffix: str, **settings) -> EmbedJob:
    folder.mkdir(exist_ok=True)
    source = folder / "in.jsonl"
    if not source.exists():
        _input(folder)
    return EmbedJob(
        source, folder / f"out{suffix}", id_field="id", chunk_size=8, progress=False, **settings
    )


def _snapshot(folder: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            files[str(path.relative_to(folder))] = path.read_bytes()
    return files


def _crash_after(monkeypatch, num_chunks: int) -> None:
    """The job's engine calls raise KeyboardInterrupt (a kill) after `num_chunks` chunks."""
    real = local.embed_chunk
    calls = {"n": 0}

    def crashing(llm, rows, job):
        calls["n"] += 1
        if calls["n"] > num_chunks:
            raise KeyboardInterrupt
        return real(llm, rows, job)

    monkeypatch.setattr(local, "embed_chunk", crashing)


def _read(job: EmbedJob) -> tuple[list[int], np.ndarray]:
    out = job.output
    if out.suffix == ".npy":
        array = np.load(out)
        return list(range(len(array))), array
    if out.suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return [r["index"] for r in rows], np.asarray([r["embedding"] for r in rows], np.float32)
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pydict()
    return table["index"], np.asarray(table["embedding"], np.float32)


CHANGES = {
    "dimensions": ({"dimensions": 16}, "dimensions: null → 16"),
    "normalize": ({"normalize": False}, "normalize: null → false"),
    "truncation": ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens: -1 → 8"),
    "id field": ({"id_field": None}, 'id_field: "id" → null'),
}


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_rerun_with_other_settings_is_refused_and_writes_nothing(
    tmp_path, tiny_llm, monkeypatch, suffix: str, change: str
) -> None:
    llm = tiny_llm("bert")
    job = _job(tmp_path, suffix)
    _crash_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_embed_job(llm, job)
    monkeypatch.undo()
    before = _snapshot(tmp_path)
    settings, expected = CHANGES[change]
    with pytest.raises(JobError) as refused:
        run_embed_job(llm, replace(job, **settings))
    message = str(refused.value)
    assert expected in message and "--overwrite" in message, message
    assert _snapshot(tmp_path) == before  # nothing written, nothing cut, no lock left
    # The same settings resume; --overwrite starts again with the new ones.
    assert run_embed_job(llm, job).num_resumed == 16
    result = run_embed_job(llm, replace(job, overwrite=True, **settings))
    assert (result.num_resumed, result.num_embedded) == (0, NUM_ROWS)


@pytest.mark.parametrize("suffix", FORMATS)
def test_another_model_is_refused(tmp_path, tiny_llm, monkeypatch, suffix: str) -> None:
    job = _job(tmp_path, suffix)
    _crash_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        run_embed_job(tiny_llm("bert"), job)
    monkeypatch.undo()
    before = _snapshot(tmp_path)
    with pytest.raises(JobError) as refused:
        run_embed_job(tiny_llm("bert-mean"), job)
    assert "model:" in str(refused.value) and "model_fingerprint" in str(refused.value)
    assert _snapshot(tmp_path) == before


def test_a_finished_output_is_not_resumed_with_other_settings(tmp_path, tiny_llm) -> None:
    llm = tiny_llm("bert")
    job = _job(tmp_path, ".jsonl")
    run_embed_job(llm, job)
    assert run_embed_job(llm, job).num_embedded == 0  # the same command: nothing left to do
    before = _snapshot(tmp_path)
    with pytest.raises(JobError, match="dimensions"):
        run_embed_job(llm, replace(job, dimensions=8))
    assert _snapshot(tmp_path) == before


def test_a_changed_input_is_refused(tmp_path, tiny_llm, monkeypatch) -> None:
    llm = tiny_llm("bert")
    job = _job(tmp_path, ".npy")
    _crash_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        run_embed_job(llm, job)
    monkeypatch.undo()
    lines = job.input.read_text().splitlines(keepends=True)
    job.input.write_text("".join([lines[1], lines[0], *lines[2:]]))  # same size, other rows
    with pytest.raises(JobError, match="input.prefix_sha256"):
        run_embed_job(llm, job)


def test_an_output_without_manifest_is_refused(tmp_path, tiny_llm) -> None:
    job = _job(tmp_path, ".jsonl")
    job.output.write_text('{"index": 0, "embedding": [1.0]}\n')  # another program's, or older
    with pytest.raises(JobError, match="no manifest"):
        run_embed_job(tiny_llm("bert"), job)
    assert job.output.read_text() == '{"index": 0, "embedding": [1.0]}\n'


@pytest.mark.parametrize("suffix", FORMATS)
def test_a_second_job_on_the_same_output_is_refused(tmp_path, tiny_llm, suffix: str) -> None:
    llm = tiny_llm("bert")
    clean = _job(tmp_path / "clean", suffix)
    run_embed_job(llm, clean)
    job = _job(tmp_path, suffix)
    in_first_chunk, go_on = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def checkpoint(name: str) -> None:
        if name == "after_ack" and not in_first_chunk.is_set():
            in_first_chunk.set()
            assert go_on.wait(60)

    def first() -> None:
        try:
            run_embed_job(llm, job, checkpoint)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=first)
    thread.start()
    assert in_first_chunk.wait(60)
    # A second writer (another open file description: flock refuses it as it would another
    # process) stops at once, whatever its settings.
    for second in (job, replace(job, dimensions=8), replace(job, overwrite=True)):
        with pytest.raises(JobError, match="another job is writing"):
            run_embed_job(llm, second)
    go_on.set()
    thread.join(60)
    assert not errors
    indexes, vectors = _read(job)
    clean_indexes, clean_vectors = _read(clean)
    assert indexes == clean_indexes == list(range(NUM_ROWS))
    np.testing.assert_array_equal(vectors, clean_vectors)
    assert not (tmp_path / f"out{suffix}.lock").exists()


def test_the_lock_is_refused_and_released(tmp_path) -> None:
    path = tmp_path / "out.npy.lock"
    with OutputLock(path, "out.npy"):
        with pytest.raises(JobError, match="another job is writing out.npy"):
            OutputLock(path, "out.npy")
    with OutputLock(path, "out.npy"):  # released: free again
        pass
    assert not path.exists()


def test_manifest_fields(tmp_path, tiny_llm, tiny_model_path) -> None:
    llm = tiny_llm("bert")
    job = _job(tmp_path, ".parquet", prompt_name=None)
    manifest = job_manifest(llm, job)
    assert manifest["model"] == str(tiny_model_path("bert"))
    assert manifest["dtype"] == "float32" and manifest["quantization"] is None
    assert manifest["output_format"] == ".parquet" and manifest["task"] == "embed"
    assert manifest["input"]["size"] == job.input.stat().st_size
    assert differences(manifest, json.loads(json.dumps(manifest))) == []
    # The fingerprint follows the files, not the folder's name.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_model_path("bert").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert model_fingerprint(copy) == manifest["model_fingerprint"]
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("0.2", "0.3"))
    assert model_fingerprint(copy) != manifest["model_fingerprint"]
