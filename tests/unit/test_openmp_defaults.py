"""tidepool's OpenMP defaults (envs.apply_openmp_defaults): PASSIVE waiting with a short spin
unless the user chose a policy; set before torch loads, so each case runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tidepool import envs

_SHOW = "import os, tidepool; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize(
    "given,expected",
    [
        ({}, f"PASSIVE {envs.SPIN_COUNT}"),
        ({"GOMP_SPINCOUNT": "0"}, "PASSIVE 0"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),  # the user's policy, no spin count added
    ],
)
def test_defaults_respect_the_users_choice(given: dict[str, str], expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", _SHOW], env={**env, **given}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == expected


@pytest.mark.parametrize(
    "code,given,missed",
    [
        ("import torch, tidepool", {}, "True"),  # libgomp loaded first: its spinning wait stays
        ("import torch, tidepool", {"OMP_WAIT_POLICY": "ACTIVE"}, "False"),  # the user's choice
        ("import tidepool, torch", {}, "False"),  # tidepool's default applied
    ],
)
def test_torch_first_is_noticed(code: str, given: dict[str, str], missed: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    show = f"{code}; from tidepool import envs; print(envs.openmp_defaults_missed())"
    out = subprocess.run(
        [sys.executable, "-c", show], env={**env, **given}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == missed


def test_engine_warns_once_when_torch_came_first(monkeypatch, caplog) -> None:
    from tidepool.engine import llm_engine

    monkeypatch.setattr(envs, "_OPENMP_DEFAULTS_MISSED", True)
    monkeypatch.setattr(llm_engine, "_warned_openmp", False)
    with caplog.at_level("WARNING", logger="tidepool"):
        llm_engine.apply_num_threads(None)
        llm_engine.apply_num_threads(None)
    warned = [r for r in caplog.records if "OMP_WAIT_POLICY=PASSIVE" in r.getMessage()]
    assert len(warned) == 1
