"""kernels/cpu_features.py: the ISA levels per CPU kind (fake flag sets, so every machine checks
every kind), the TIDEPOOL_CPU_ISA cap and its bad values, and the kernels' choice of build."""

from __future__ import annotations

import pytest

from tidepool import envs
from tidepool.attention import cpu_kernels
from tidepool.kernels import cpu_features

_AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
CPUS = {
    # this project's AMD EPYC (Zen 3)
    "zen3": {"avx2", "fma"},
    # an Alder Lake laptop: AVX-VNNI, no AVX-512
    "alder-lake": {"avx2", "fma", "avx_vnni"},
    "skylake-x": _AVX512,
    # AMD EPYC Zen 4 (issue 27's machine): AVX-512 VNNI and BF16, no AMX
    "zen4": _AVX512 | {"avx512_vnni", "avx512_bf16"},
    "sapphire-rapids": _AVX512
    | {"avx_vnni", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
}
USABLE = {
    "zen3": ["avx2"],
    "alder-lake": ["avx2", "avx2_vnni"],
    "skylake-x": ["avx2", "avx512"],
    "zen4": ["avx2", "avx512", "avx512_vnni", "avx512_bf16"],
    "sapphire-rapids": list(cpu_features.LEVELS),
}


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend the CPU has the given flags (and no cap unless the test sets one)."""

    def use(flags: set[str], cap: str | None = None) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
        if cap is None:
            monkeypatch.delenv("TIDEPOOL_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("TIDEPOOL_CPU_ISA", cap)
        cpu_features.reset()

    yield use
    monkeypatch.undo()
    cpu_features.reset()


@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_cpu_kind_gets_its_levels_and_builds(fake_cpu, cpu):
    fake_cpu(CPUS[cpu])
    assert [level for level in cpu_features.LEVELS if cpu_features.usable(level)] == USABLE[cpu]
    expected = "avx512" if "avx512" in USABLE[cpu] else "avx2"
    assert cpu_kernels.chosen_isa() == expected


def test_the_cap_lowers_the_build_and_never_raises_it(fake_cpu):
    fake_cpu(CPUS["sapphire-rapids"], cap="avx2")
    assert cpu_kernels.chosen_isa() == "avx2"
    assert not cpu_features.usable("amx") and not cpu_features.usable("avx512")
    assert "TIDEPOOL_CPU_ISA=avx2" in cpu_features.why_not("avx512")
    fake_cpu(CPUS["sapphire-rapids"], cap="avx512_bf16")
    assert cpu_features.usable("avx512_bf16") and not cpu_features.usable("amx")
    fake_cpu(CPUS["zen3"], cap="amx")  # above what the CPU has: changes nothing
    assert cpu_kernels.chosen_isa() == "avx2" and not cpu_features.usable("avx512")
    assert cpu_features.why_not("avx512") == "the CPU lacks avx512f, avx512bw, avx512dq, avx512vl"


def test_a_cpu_without_avx2_gets_no_build(fake_cpu):
    fake_cpu({"fma"})
    assert cpu_kernels.chosen_isa() is None
    assert cpu_features.why_not("avx2") == "the CPU lacks avx2"
    fake_cpu(set())  # not x86-64, or no /proc/cpuinfo
    assert cpu_kernels.chosen_isa() is None and "no x86-64" in cpu_features.why_not("avx2")


@pytest.mark.parametrize("value", ["avx3", "AVX-512", "sse4", "native", " avx2"])
def test_bad_values_of_the_switch_are_refused(monkeypatch, value):
    monkeypatch.setenv("TIDEPOOL_CPU_ISA", value)
    cpu_features.reset()
    try:
        with pytest.raises(ValueError, match="TIDEPOOL_CPU_ISA must be one of auto, avx2"):
            cpu_features.usable("avx2")
    finally:
        monkeypatch.undo()
        cpu_features.reset()


def test_the_switch_names_every_level_and_is_case_blind(monkeypatch):
    assert envs.CPU_ISAS == ("auto", *cpu_features.LEVELS)
    monkeypatch.setenv("TIDEPOOL_CPU_ISA", "AVX2")
    assert envs.cpu_isa() == "avx2"
    monkeypatch.delenv("TIDEPOOL_CPU_ISA")
    assert envs.cpu_isa() == "auto"


def test_this_machine_is_described_with_its_flags():
    line = cpu_features.describe()
    assert cpu_features.cpu_model() in line
    assert all(flag in line for flag in cpu_features.cpu_flags())
