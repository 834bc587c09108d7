"""tidepool.ray on a local Ray cluster started by this module (2 CPUs, no dashboard).

Ray Data jobs must equal the single-process `LLM` row for row, also when an actor dies mid-job;
bad rows land in the error column; the Serve deployment answers like `tidepool serve`; and
`tidepool embed --ray` writes every row once and resumes file by file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytest.importorskip("ray.serve")

from tidepool import LLM  # noqa: E402
from tidepool.checkpoint.loader import DEFAULT_MODEL  # noqa: E402
from tidepool.entrypoints.cli import main  # noqa: E402
from tidepool.jobs.demo import demo_corpus  # noqa: E402
from tidepool.jobs.plan import DONE_DIR, SUCCESS  # noqa: E402
from tidepool.ray import Predictor, embed_dataset, score_dataset  # noqa: E402

pytestmark = pytest.mark.slow

NUM_TEXTS = 96
BATCH = 16


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    # Classes of this module (CrashOnce) travel to the actors by value: workers cannot import it.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    # Generated sentences plus long ones: batches mix lengths, as a real corpus does.
    return demo_corpus(NUM_TEXTS - 6) + ["tidepool " * (50 * k) for k in range(1, 7)]


@pytest.fixture(scope="module")
def expected(minilm_llm: LLM, texts: list[str]) -> np.ndarray:
    outputs = minilm_llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)


def assert_rows_match(actual: list, expected: np.ndarray) -> None:
    actual = np.asarray(actual, dtype=np.float32)
    assert actual.shape == expected.shape
    cos = (actual * expected).sum(1) / np.linalg.norm(actual, axis=1)
    cos /= np.linalg.norm(expected, axis=1)
    assert cos.min() >= 0.99999, cos.min()


def rows_by_id(dataset) -> list[dict]:
    rows = dataset.take_all()
    ids = [row["id"] for row in rows]
    assert sorted(ids) == sorted(set(ids)), "a row came out twice"
    return sorted(rows, key=lambda row: row["id"])


# ---------------------------------------------------------------------- Ray Data


def test_two_actors_equal_the_single_process_engine(texts, expected) -> None:
    items = [{"id": i, "text": t} for i, t in enumerate(texts)]
    ds = ray.data.from_items(items, override_num_blocks=6)
    rows = rows_by_id(embed_dataset(ds, DEFAULT_MODEL, concurrency=2, batch_size=BATCH))
    assert [row["id"] for row in rows] == list(range(len(texts)))
    assert [row["text"] for row in rows] == texts  # input columns pass through
    assert all(row["error"] is None for row in rows)
    assert_rows_match([row["embedding"] for row in rows], expected)


class CrashOnce(Predictor):
    """Kills its process on its first batch, once per job (the marker file says it happened)."""

    def __init__(self, marker: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker = marker

    def __call__(self, batch):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))  # only one actor wins
        except FileExistsError:
            return super().__call__(batch)
        os._exit(1)


def test_an_actor_dying_mid_job_loses_and_doubles_no_row(tmp_path, texts, expected) -> None:
    marker = tmp_path / "crashed"
    items = [{"id": i, "text": t} for i, t in enumerate(texts)]
    ds = ray.data.from_items(items, override_num_blocks=6).map_batches(
        CrashOnce,
        fn_constructor_kwargs={"marker": str(marker), "model": DEFAULT_MODEL, "num_threads": 1},
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1,
        batch_size=BATCH,
        batch_format="pyarrow",
    )
    rows = rows_by_id(ds)
    assert marker.exists()  # an actor did die
    assert [row["id"] for row in rows] == list(range(len(texts)))
    assert_rows_match([row["embedding"] for row in rows], expected)


def test_bad_rows_land_in_the_error_column(minilm_llm: LLM) -> None:
    import pandas as pd

    values = ["fine", "", None, 3, "also fine", "long " * 600]
    ds = ray.data.from_pandas(pd.DataFrame({"id": range(len(values)), "text": values}))
    out = embed_dataset(ds, output_dtype="float16", truncate_prompt_tokens=None, batch_size=4)
    rows = rows_by_id(out)
    assert len(rows) == len(values)  # nothing dropped
    errors = [row["error"] for row in rows]
    assert errors[0] is None and errors[4] is None
    assert "empty string" in errors[1]
    assert "type None" in errors[2] and "type int" in errors[3]
    assert "more than the model's maximum" in errors[5]
    assert [row["embedding"] is None for row in rows] == [e is not None for e in errors]
    reference = minilm_llm.embed(["fine", "also fine"], use_tqdm=False)
    good = [rows[0]["embedding"], rows[4]["embedding"]]
    assert str(out.schema().base_schema.field("embedding").type.value_type) == "halffloat"
    assert_rows_match(good, np.asarray([o.outputs.embedding for o in reference]))


def test_score_dataset_with_a_cross_encoder(tiny_model_path, tiny_llm) -> None:
    path = str(tiny_model_path("bert-cross-encoder"))
    queries = ["what is a tide pool?"] * 3 + ["capital of france", ""]
    documents = ["rocks and sea water", "a pool of tides", "vectors", "Paris", "x"]
    items = [
        {"id": i, "q": q, "d": d} for i, (q, d) in enumerate(zip(queries, documents, strict=True))
    ]
    out = score_dataset(
        ray.data.from_items(items),
        path,
        column="q",
        pair_column="d",
        engine_kwargs={"dtype": "float32", "device": "cpu"},
    )
    rows = rows_by_id(out)
    reference = tiny_llm("bert-cross-encoder").score(queries[:4], documents[:4], use_tqdm=False)
    np.testing.assert_allclose(
        [row["score"] for row in rows[:4]], [r.outputs.score for r in reference], rtol=1e-5
    )
    assert rows[4]["score"] is None and "empty string" in rows[4]["error"]


# ---------------------------------------------------------------------- Ray Serve


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ERROR_REQUESTS = [
    ("POST", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": [""]}),
    ("POST", "/v1/embeddings", {"model": "no-such-model", "input": "hi"}),
    ("POST", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": 3.5}),
    ("POST", "/v1/embeddings", b"{not json"),
    ("POST", "/v1/completions", {"model": DEFAULT_MODEL, "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/no/such/route", None),
]


def _answers(client, base: str) -> list[tuple[int, object]]:
    answers = []
    for method, route, body in ERROR_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = client.request(method, base + route, **(kwargs if body is not None else {}))
        answers.append((response.status_code, _stable(response.json())))
    return answers


def _stable(value: object) -> object:
    """JSON without the fields that differ from call to call (timestamps, permission ids)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in ("created", "permission")}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def test_serve_replicas_answer_like_tidepool_serve(minilm_llm: LLM) -> None:
    import httpx
    from fastapi.testclient import TestClient
    from openai import OpenAI
    from ray import serve

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app
    from tidepool.entrypoints.ray_serve import app_builder

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        # As `serve run tidepool.entrypoints.ray_serve:app_builder model=... num_replicas=2 num_cpus=0.5`.
        app = app_builder({"model": DEFAULT_MODEL, "num_replicas": "2", "num_cpus": "0.5"})
        serve.run(app, name="tidepool", route_prefix="/")
        status = serve.status().applications["tidepool"]
        assert status.deployments["tidepool"].replica_states == {"RUNNING": 2}

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        inputs = ["The tide pool is full of life.", "An inference engine."] * 4
        result = client.embeddings.create(model=DEFAULT_MODEL, input=inputs)
        reference = minilm_llm.embed(inputs, use_tqdm=False)
        assert_rows_match(
            [d.embedding for d in result.data],
            np.asarray([o.outputs.embedding for o in reference]),
        )

        # Errors and other routes: the same status and JSON as the app of `tidepool serve`.
        with httpx.Client(timeout=30) as http:
            served = _answers(http, f"http://127.0.0.1:{port}")
        engine = AsyncEngine.from_args(DEFAULT_MODEL)
        local_app = build_app(engine, ServerArgs(served_model_name=[DEFAULT_MODEL]))
        with TestClient(local_app) as local:
            assert served == _answers(local, "")
    finally:
        serve.shutdown()


# ---------------------------------------------------------------------- tidepool embed --ray


def _write_inputs(folder: Path, texts: list[str]) -> list[tuple[str, int, object]]:
    """a.jsonl (with bad rows and a blank line) and sub/b.parquet; returns the expected
    (source, index, text) of every row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    (folder / "sub").mkdir()
    half = len(texts) // 2
    jsonl_values: list[object] = list(texts[:half]) + ["", None, 7]
    lines = [json.dumps({"id": f"a{i}", "text": t}) for i, t in enumerate(jsonl_values)]
    lines.insert(5, "")  # a blank line is not a row
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    table = pa.table({"id": [f"b{i}" for i in range(len(texts) - half)], "text": texts[half:]})
    pq.write_table(table, folder / "sub" / "b.parquet", row_group_size=7)
    rows = [("a.jsonl", i, v) for i, v in enumerate(jsonl_values)]
    return rows + [("sub/b.parquet", i, t) for i, t in enumerate(texts[half:])]


def _read_output(folder: Path) -> list[dict]:
    import pyarrow.dataset as pads

    rows = pads.dataset(str(folder), format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda row: (row["source"], row["index"]))


def test_cli_ray_job_writes_every_row_once_and_resumes(
    tmp_path: Path, texts, expected, capsys
) -> None:
    expected_rows = _write_inputs(tmp_path / "in", texts)
    out = tmp_path / "out"
    args = ["embed", "-i", str(tmp_path / "in"), "-o", str(out), "--id-field", "id"]
    args += ["--rows-per-file", "20", "--chunk-size", "8", "--no-progress"]
    # A separate driver process joins this module's cluster by its address.
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "tidepool.entrypoints.cli", *args, "--ray", address]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 rows have no embedding" in done.stdout

    rows = _read_output(out)
    assert [(r["source"], r["index"]) for r in rows] == [(s, i) for s, i, _ in expected_rows]
    good = [
        r
        for r, (_, _, text) in zip(rows, expected_rows, strict=True)
        if isinstance(text, str) and text
    ]
    assert [r["error"] for r in rows].count(None) == len(good) == len(texts)
    order = {text: k for k, text in enumerate(texts)}
    texts_of_good = [t for _, _, t in expected_rows if isinstance(t, str) and t]
    assert_rows_match([r["embedding"] for r in good], expected[[order[t] for t in texts_of_good]])
    assert (out / SUCCESS).exists()
    num_files = len(list(out.glob("*.parquet")))
    assert num_files == len(list((out / DONE_DIR).iterdir())) == 6  # 51 + 48 rows, 20 a file

    # A rerun after a crash: one file lost its marker and was torn, one is gone altogether.
    torn, lost = sorted(out.glob("*.parquet"))[1:3]
    torn.write_bytes(torn.read_bytes()[:100])
    (out / DONE_DIR / f"{torn.name}.json").unlink()
    lost.unlink()
    (out / DONE_DIR / f"{lost.name}.json").unlink()
    capsys.readouterr()
    assert main([*args, "--ray", "auto"]) == 0  # in-process: joins the running cluster
    assert "resuming: 4 of 6 files are complete" in capsys.readouterr().out
    rerun = _read_output(out)
    without_embeddings = [{k: v for k, v in r.items() if k != "embedding"} for r in rerun]
    assert without_embeddings == [{k: v for k, v in r.items() if k != "embedding"} for r in rows]
    assert_rows_match(
        [r["embedding"] for r in rerun if r["error"] is None],
        np.asarray([r["embedding"] for r in good], dtype=np.float32),
    )

    # Other settings must not mix with this output.
    assert main([*args[:-5], "--rows-per-file", "10", "--no-progress", "--ray", "auto"]) == 1
    assert "rows_per_file: 20 → 10" in capsys.readouterr().err
