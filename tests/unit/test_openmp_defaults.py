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
