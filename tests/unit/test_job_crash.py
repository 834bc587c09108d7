"""Crash consistency of `tidepool embed`: the job is SIGKILLed in a child process at named points
(before the first chunk, mid-write, between writing rows and acknowledging them, while
finishing) and at random times; the rerun must leave every row written exactly once and equal
to a clean run's rows, every bad row reported once, and no leftovers, for .npy, .jsonl and
.parquet outputs.

The child is forked from this process, so the tiny model is loaded once; both run torch with one
thread while the module runs (OpenMP's pool does not survive a fork).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.jobs.local import EmbedJob, run_embed_job

pq = pytest.importorskip("pyarrow.parquet")

FORMATS = (".npy", ".jsonl", ".parquet")
POINTS = (
    "before_first_chunk",
    "mid_write",
    "before_ack",
    "after_ack",
    "before_finish",
    "mid_finish",
)
NUM_ROWS = 23
CHILD_TIMEOUT_S = 60


def _input(folder: Path) -> Path:
    lines = []
    for i in range(NUM_ROWS):
        if i in (5, 6, 7, 8):  # a whole chunk of bad rows, and bad rows among good ones below
            lines.append("{not json" if i % 2 else json.dumps({"text": ""}))
        elif i == 13:
            lines.append(json.dumps({"id": "r13"}))
        else:
            lines.append(json.dumps({"id": f"r{i}", "text": f"row {i} " + "tide " * (i % 5)}))
        if i == 10:
            lines.append("   ")  # a blank line is not a row
    path = folder / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def llm(tiny_llm):
    import torch

    # One torch thread in this process too while the module forks: no pool thread is busy at a
    # fork, and the children compute exactly what this process computes.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llm("bert")
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def clean(llm, tmp_path_factory) -> dict[str, tuple]:
    """Per format: the output and errors file of an uninterrupted run."""
    results = {}
    for suffix in FORMATS:
        folder = tmp_path_factory.mktemp("clean")
        job = _job(_input(folder), folder / f"out{suffix}")
        run_embed_job(llm, job)
        results[suffix] = _contents(job)
    return results


def _job(src: Path, out: Path) -> EmbedJob:
    return EmbedJob(src, out, id_field="id", chunk_size=4, progress=False)


def _contents(job: EmbedJob) -> tuple:
    """(input rows written, their ids, their embeddings, the errors file's reports)."""
    out = job.output
    errors = out.with_name(out.name + ".errors.jsonl").read_text().splitlines()
    if out.suffix == ".npy":
        array = np.load(out)
        good = ~np.isnan(array).any(axis=1)
        return np.flatnonzero(good).tolist(), None, array[good], errors
    if out.suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        vectors = np.asarray([r["embedding"] for r in rows], np.float32)
        return [r["index"] for r in rows], [r.get("id") for r in rows], vectors, errors
    table = pq.read_table(out).to_pydict()
    vectors = np.asarray(table["embedding"], np.float32)
    return table["index"], table["id"], vectors, errors


def _run_in_child(llm, job: EmbedJob, point: str | None, count: int, sleep_s: float = 0.0) -> int:
    """Fork; the child runs the job and SIGKILLs itself at the `count`-th `point` (or sleeps
    `sleep_s` at every point, to be killed from outside). Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    status = 3
    try:
        import faulthandler
        import threading

        import torch
        from tqdm import tqdm

        # tqdm's write lock is a multiprocessing lock shared with the parent across the fork: a
        # child killed while holding it (tqdm takes it to create a bar) would leave the parent's
        # next bar waiting forever. The child takes a lock of its own.
        tqdm.set_lock(threading.RLock())

        # A child that hangs says where, on stderr, and ends before the parent gives up on it.
        faulthandler.dump_traceback_later(CHILD_TIMEOUT_S / 2, exit=True, file=sys.__stderr__)

        torch.set_num_threads(1)
        seen = {"count": 0}

        def checkpoint(name: str) -> None:
            if name == point:
                seen["count"] += 1
                if seen["count"] == count:
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(sleep_s)

        run_embed_job(llm, job, checkpoint)
        status = 0
    except BaseException:
        import traceback

        # The parent sees exit status 3; this says why (sys.stderr may be pytest's buffer).
        os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(status)


def _wait(pid: int, kill_after_s: float | None = None) -> int:
    deadline = time.monotonic() + (CHILD_TIMEOUT_S if kill_after_s is None else kill_after_s)
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert kill_after_s is not None, "the child hung"
    return status


def _check_rerun(llm, job: EmbedJob, expected: tuple, capsys) -> None:
    result = run_embed_job(llm, job)
    indexes, ids, vectors, errors = _contents(job)
    assert indexes == expected[0]  # every row once, in order
    assert ids == expected[1]
    np.testing.assert_allclose(vectors, expected[2], rtol=1e-5, atol=1e-6)
    assert errors == expected[3]  # every bad row reported once
    assert result.num_skipped == len(expected[3])
    leftovers = {p.name for p in job.output.parent.iterdir()}
    name = job.output.name
    assert leftovers == {job.input.name, name, name + ".errors.jsonl", name + ".manifest.json"}
    said = capsys.readouterr().out
    if "resuming" in said:  # what it says is there, is there
        resumed = int(said.split("resuming: ")[1].split()[0])
        assert resumed == result.num_resumed <= NUM_ROWS


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize(
    ("point", "count"),
    [
        ("before_first_chunk", 1),
        ("mid_write", 1),  # the first chunk half written (.npy: maybe before a header)
        ("before_ack", 1),  # the first chunk's rows written, not acknowledged
        ("before_ack", 3),  # after a chunk of bad rows only
        ("mid_write", 4),
        ("before_finish", 1),
        ("mid_finish", 1),
    ],
)
def test_killed_at_a_named_point_then_rerun(
    tmp_path, llm, clean, capsys, suffix: str, point: str, count: int
) -> None:
    job = _job(_input(tmp_path), tmp_path / f"out{suffix}")
    status = _wait(_run_in_child(llm, job, point, count))
    if suffix == ".jsonl" and point.endswith("finish"):
        assert status == 0  # a .jsonl output is complete with its last line: no finish step
    else:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    _check_rerun(llm, job, clean[suffix], capsys)


@pytest.mark.parametrize("suffix", FORMATS)
def test_killed_while_writing_its_manifest_then_rerun(tmp_path, llm, clean, capsys, suffix) -> None:
    # What test_killed_at_a_random_time_then_rerun met now and then: a job killed inside the
    # manifest's atomic write leaves OUTPUT.manifest.json.tmp alone, which the rerun took for
    # rows of an older version ("holds rows but no manifest") and refused.
    job = _job(_input(tmp_path), tmp_path / f"out{suffix}")
    tmp_path.joinpath(f"out{suffix}.manifest.json.tmp").write_bytes(b'{"manifest_ver')
    _check_rerun(llm, job, clean[suffix], capsys)


def test_npy_killed_in_its_first_chunk_claims_no_rows(tmp_path, llm, clean, capsys) -> None:
    # The bug of issue 18: the rerun said "23 of 23 rows are already there" over zero rows.
    job = _job(_input(tmp_path), tmp_path / "out.npy")
    _wait(_run_in_child(llm, job, "before_ack", 1))
    assert run_embed_job(llm, job).num_resumed == 0
    assert "resuming" not in capsys.readouterr().out
    _check_rerun(llm, job, clean[".npy"], capsys)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    suffix=st.sampled_from(FORMATS),
    kills=st.lists(st.tuples(st.sampled_from(POINTS), st.integers(1, 6)), min_size=1, max_size=3),
)
def test_killed_again_and_again_then_rerun(
    tmp_path_factory, llm, clean, capsys, suffix: str, kills: list[tuple[str, int]]
) -> None:
    folder = tmp_path_factory.mktemp("kills")
    job = _job(_input(folder), folder / f"out{suffix}")
    for point, count in kills:  # each run resumes the last one, and is killed in turn
        _wait(_run_in_child(llm, job, point, count))
    _check_rerun(llm, job, clean[suffix], capsys)


@pytest.mark.parametrize("suffix", FORMATS)
def test_killed_at_a_random_time_then_rerun(tmp_path, llm, clean, capsys, suffix: str) -> None:
    rng = random.Random()  # truly random: the seed is printed if it fails
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    job = _job(_input(tmp_path), tmp_path / f"out{suffix}")
    for _ in range(3):
        pid = _run_in_child(llm, replace(job), None, 0, sleep_s=0.01)
        _wait(pid, kill_after_s=rng.uniform(0.0, 0.3))
    try:
        _check_rerun(llm, job, clean[suffix], capsys)
    except AssertionError as e:
        raise AssertionError(f"random kill, seed {seed}") from e
