"""Builds tidepool's C++ kernels when the package is installed (pyproject.toml holds the rest).

One module per kernel per ISA build (src/tidepool/kernels/specs.py: AVX-512 and AVX2 + FMA of
the encoder attention, decoder ops, int8 ops and paged decode; the AMX int8 GEMM), with torch's BuildExtension against the torch
installed in the target environment, into tidepool/kernels/_prebuilt/ (also for editable
installs: the loader looks there, kernels/build.py). The modules build in parallel, one per core.
Without torch (or a C++ compiler) at install time the package installs without them and each
kernel is built on first use instead, as for an edited source.

pip builds in an isolated environment without the target's packages: the torch of the
environment being installed into is then found by asking its interpreter (the one pip runs),
so `pip install -e .` needs no --no-build-isolation (it works with it too).
TIDEPOOL_SKIP_KERNEL_BUILD=1 installs without the kernels.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def _specs():
    """kernels/specs.py alone (it imports nothing of tidepool)."""
    path = HERE / "src" / "tidepool" / "kernels" / "specs.py"
    spec = importlib.util.spec_from_file_location("_tidepool_kernel_specs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _find_target_torch() -> bool:
    """Make the target environment's torch importable here; False where it has none."""
    # Under pip's build isolation numpy is not importable here; the build does not need it, and
    # torch's warning about it would be printed by pip once per build hook.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch  # noqa: F401

        return True
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    probe = "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"
    found = subprocess.run(
        [sys.executable, "-I", "-c", probe], env=env, capture_output=True, text=True
    )
    if found.returncode != 0:
        return False
    sys.path.append(found.stdout.strip().splitlines()[-1])
    try:
        import torch  # noqa: F401, F811
    except ImportError:
        return False
    return True


def _unit(build) -> str:
    """A one-line source that includes `build`'s: each build of a source (one per ISA) then
    compiles to its own object file (setuptools names objects after their sources, and the
    builds run in parallel); the included source finds csrc/'s headers beside itself."""
    units = HERE / "build" / "tidepool_kernels"
    units.mkdir(parents=True, exist_ok=True)
    unit = units / f"{build.name}.cpp"
    text = f'#include "{build.path.as_posix()}"\n'
    if not unit.is_file() or unit.read_text() != text:
        unit.write_text(text)
    return str(unit.relative_to(HERE))


def _kernel_build():
    """(ext_modules, cmdclass) for the kernels, or ([], {}) where they cannot be built."""
    if os.environ.get("TIDEPOOL_SKIP_KERNEL_BUILD") == "1" or not _find_target_torch():
        print("tidepool: kernels not built at install (no torch): built on first use instead")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    specs = _specs()
    extensions = [
        CppExtension(
            f"{specs.PREBUILT_PACKAGE}.{build.name}",
            [_unit(build)],
            extra_compile_args=list(build.cflags),
            extra_link_args=["-fopenmp"],
        )
        for build in specs.all_builds()
    ]

    class BuildKernels(BuildExtension):
        """BuildExtension without ninja (one compile per module, modules in parallel: ninja's
        build file is per directory and parallel modules would share it); a module that fails
        (an old compiler without AMX flags) is left out with one line: it is built on first
        use, where it can be."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if self.parallel is None:
                self.parallel = os.cpu_count() or 1

        def build_extensions(self) -> None:
            # Python's own CFLAGS (-g, -DNDEBUG, -fwrapv, -Wall) are not the first-use build's
            # (torch's loader): without them the two builds compile the same code (and no
            # debug info is made).
            drop = {"-g", "-DNDEBUG", "-fwrapv", "-Wall", "-Wsign-compare"}
            for attr in (
                "compiler_so",
                "compiler_so_cxx",
                "compiler_cxx",
                "linker_so",
                "linker_so_cxx",
            ):
                flags = getattr(self.compiler, attr, None)
                if flags:
                    setattr(self.compiler, attr, [f for f in flags if f not in drop])
            # An editable install copies each module into the source tree, here; the modules
            # of earlier sources (names no build has now) go.
            prebuilt = HERE / "src" / "tidepool" / "kernels" / "_prebuilt"
            prebuilt.mkdir(exist_ok=True)
            current = {build.name for build in specs.all_builds()}
            for stale in prebuilt.glob("*.so"):
                if stale.name.split(".")[0] not in current:
                    stale.unlink()
            super().build_extensions()

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as e:  # CompileError, LinkError
                print(f"tidepool: {ext.name} not built ({type(e).__name__}); built on first use")

    return extensions, {"build_ext": BuildKernels.with_options(use_ninja=False)}


ext_modules, cmdclass = _kernel_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
