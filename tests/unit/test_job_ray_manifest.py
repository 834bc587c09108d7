"""The Ray job's manifest and lock (issue 26), without starting Ray: a rerun whose model,
weights, settings or input differ from OUTPUT/_tidepool_job.json is refused before Ray is
joined, listing what differs; a second job on a local OUTPUT stops at once."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tidepool.jobs.formats import JobError
from tidepool.jobs.manifest import OutputLock
from tidepool.jobs.plan import MANIFEST, RayEmbedJob, canonical_uri, plan_job, prepare_output
from tidepool.jobs.ray_runner import run_ray_embed_job

pytest.importorskip("pyarrow")


@pytest.fixture
def job(tmp_path: Path, tiny_model_path) -> RayEmbedJob:
    source = tmp_path / "in.txt"
    source.write_text("".join(f"row {i}\n" for i in range(25)))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path("bert"), model)
    job = RayEmbedJob(str(source), str(tmp_path / "out"), str(model), rows_per_file=10)
    plan = plan_job(job)
    prepare_output(plan.output_fs, plan.output_path, job.settings(canonical_uri(job.input), plan),
                   overwrite=False)  # fmt: skip
    return job


def _refusal(job: RayEmbedJob) -> str:
    with pytest.raises(JobError) as refused:
        run_ray_embed_job(job, address=None)  # refused before Ray: no cluster needed
    return str(refused.value)


def test_the_manifest_records_the_model_and_the_input(job: RayEmbedJob) -> None:
    manifest = json.loads((Path(job.output) / MANIFEST).read_text())
    assert manifest["model_fingerprint"] and manifest["dtype"] == "float32"
    assert manifest["input_files"]["in.txt"]["size"] == Path(job.input).stat().st_size


def test_other_settings_are_refused(job: RayEmbedJob) -> None:
    before = sorted(p.name for p in Path(job.output).iterdir())
    assert "dimensions: null → 8" in _refusal(replace(job, dimensions=8))
    assert "truncate_prompt_tokens: -1 → null" in _refusal(
        replace(job, truncate_prompt_tokens=None)
    )
    assert sorted(p.name for p in Path(job.output).iterdir()) == before


def test_other_weights_are_refused(job: RayEmbedJob) -> None:
    config = Path(job.model) / "config.json"
    config.write_text(config.read_text().replace("0.2", "0.25"))
    assert "model_fingerprint" in _refusal(job)


def test_a_changed_input_is_refused(job: RayEmbedJob) -> None:
    with open(job.input, "a") as f:
        f.write("one more row\n")
    assert "input_files.in.txt.size" in _refusal(job)


def test_a_second_job_is_refused(job: RayEmbedJob) -> None:
    with OutputLock(Path(job.output + ".lock"), job.output):
        assert "another job is writing" in _refusal(job)
