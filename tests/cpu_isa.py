"""Running a kernel test once per ISA build of tidepool's CPU kernels (csrc/cpu_simd.h): each
build the CPU can run, chosen through the TIDEPOOL_CPU_ISA cap (kernels/cpu_features.py) so
that the models and layers built in the test take it too; the builds the CPU cannot run are
skipped with the flags they lack in the reason."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tidepool.kernels import cpu_features


def isa_params(levels: tuple[str, ...]) -> list:
    """One pytest.param per build, skipped where the CPU lacks its instruction sets."""
    return [
        pytest.param(
            isa,
            marks=pytest.mark.skipif(
                not cpu_features.cpu_has(isa),
                reason=f"the {isa} build needs {', '.join(cpu_features.LEVELS[isa])}: "
                + cpu_features.why_not(isa),
            ),
        )
        for isa in levels
    ]


def build_fixture(levels: tuple[str, ...], load_isa: Callable[[str], object], what: str):
    """A fixture, parametrized over `levels`, that caps the kernels at its build for the test
    (and skips where `load_isa(isa)` cannot build it: no C++ compiler)."""

    @pytest.fixture(params=isa_params(levels))
    def fixture(request, monkeypatch):
        isa = request.param
        if load_isa(isa) is None:
            pytest.skip(f"the {isa} build of {what} did not build here (a C++ compiler?)")
        monkeypatch.setenv("TIDEPOOL_CPU_ISA", isa)
        cpu_features.reset()
        yield isa
        monkeypatch.undo()
        cpu_features.reset()

    return fixture
