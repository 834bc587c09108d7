"""The kernels built when the package is installed (setup.py, kernels/specs.py): an installed
package loads them with no C++ compiler and builds nothing; an edited source is not taken for
its installed build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tidepool.kernels import build, cpu_features, specs

_INSTALLED = [b for b in specs.all_builds() if build.prebuilt_path(b) is not None]


def test_every_kernel_has_one_build_per_isa_with_its_own_name() -> None:
    builds = specs.all_builds()
    names = [b.name for b in builds]
    assert len(set(names)) == len(names)
    for family in (specs.ENCODER_ATTENTION, specs.DECODER_OPS, specs.INT8_OPS, specs.PAGED_DECODE):
        assert set(family) == {"avx512", "avx2"}
        assert len({b.namespace for b in family.values()}) == 2
    assert all(b.path.is_file() for b in builds)


def test_an_edited_source_or_flag_has_no_installed_build(tmp_path, monkeypatch) -> None:
    """The name carries the source's, the headers' and the flags' hash: another flag (as an
    edited source) names a module the package build never made, so it is built on first use."""
    original = specs.INT8_OPS["avx2"]
    edited = replace(original, cflags=(*original.cflags, "-DEDITED"))
    assert edited.name != original.name and edited.name.startswith(original.prefix + "_")
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path)
    (tmp_path / f"{original.name}.cpython-311-x86_64-linux-gnu.so").touch()
    (tmp_path / f"{original.name}0.so").touch()  # another name sharing the prefix
    assert (
        build.prebuilt_path(original)
        == tmp_path / f"{original.name}.cpython-311-x86_64-linux-gnu.so"
    )
    assert build.prebuilt_path(edited) is None


_LOAD_ALL = textwrap.dedent(
    """
    import json, sys
    from tidepool.attention import cpu_decoder_ops, cpu_kernels, cpu_paged_decode
    from tidepool.kernels import build, cpu_features
    from tidepool.quantization import int8_ops

    isas = [i for i in ("avx512", "avx2") if cpu_features.cpu_has(i)]
    loaded = {
        "attention": [cpu_kernels.load_isa(i) is not None for i in isas],
        "decoder": [cpu_decoder_ops.load(i) is not None for i in isas],
        "int8": [int8_ops.load(i) is not None for i in isas],
        "paged": [cpu_paged_decode.load(i) is not None for i in isas],
        "amx": int8_ops.load_amx() is not None if cpu_features.usable("amx") else None,
    }
    print(json.dumps({"loaded": loaded, "how": build.LOADED}))
    """
)


@pytest.mark.skipif(
    len(_INSTALLED) < len(specs.all_builds()) - 1,  # the AMX GEMM needs a recent compiler
    reason="this tidepool was not installed with its kernels for these sources "
    "(pip install -e . builds them; a PYTHONPATH tree or an edited source has none)",
)
@pytest.mark.skipif(not cpu_features.cpu_has("avx2"), reason="the kernels need AVX2 + FMA")
def test_installed_kernels_load_without_a_compiler(tmp_path) -> None:
    """A machine without a C++ compiler (PATH without c++ / g++ / gcc, an empty torch
    extensions cache) gets every kernel this CPU runs from the installed build, and nothing is
    built: no module took the first-use path, and no compiler output appears."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    env = dict(
        os.environ,
        PATH=str(bin_dir),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),
        CXX="/nonexistent/c++",
        CC="/nonexistent/cc",
        TIDEPOOL_CPU_ATTENTION="native",  # a kernel that cannot load is an error, not SDPA
    )
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_ALL], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    loaded = result["loaded"]
    assert all(loaded["attention"]) and all(loaded["decoder"]) and all(loaded["int8"])
    assert all(loaded["paged"]) and loaded["amx"] in (None, True)
    assert result["how"] and set(result["how"].values()) == {"prebuilt"}
    assert not (tmp_path / "torch_extensions").exists() or not any(
        (tmp_path / "torch_extensions").rglob("*.so")
    )
    assert "error" not in done.stderr.lower() and "g++" not in done.stderr
    assert Path(build.PREBUILT_DIR).is_dir()
