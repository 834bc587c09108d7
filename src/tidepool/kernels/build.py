"""The one loader of tidepool's C++ kernels (builds in kernels/specs.py), for attention, the
decoders and quantization.

`load_build(build)`: the module the package build made (setup.py: one .so per kernel per ISA
build, under tidepool/kernels/_prebuilt/) when its name, which carries the hash of the source,
the headers and the flags, is there; else the developers' path: torch's C++ extension loader
builds it now (~10-40 s once per machine, cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions; it needs a C++ compiler and ninja). So an installed package runs
its kernels with no compiler, and an edited source is rebuilt on first use.
`build_or_fall_back` turns a failure into one warning line and the caller's torch path.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidepool import envs
from tidepool.kernels import cpu_features
from tidepool.kernels.specs import KernelBuild

logger = logging.getLogger("tidepool")

PREBUILT_DIR = Path(__file__).resolve().parent / "_prebuilt"
"""Where the package build puts its modules (kernels/specs.py's PREBUILT_PACKAGE)."""
LOADED: dict[str, str] = {}
"""Module name → "prebuilt" or "jit": how each kernel build this process loaded got here
(the tests assert that an installed package built nothing)."""


def prebuilt_path(build: KernelBuild) -> Path | None:
    """The installed module of `build` ({name}.so, or with Python's extension suffix), None
    where the package build made none for these sources."""
    for path in sorted(PREBUILT_DIR.glob(f"{build.name}*.so")):
        if path.name == f"{build.name}.so" or path.name.startswith(f"{build.name}."):
            return path
    return None


def load_build(build: KernelBuild) -> None:
    """Load `build`'s module into this process (its ops register under torch.ops); raises where
    it cannot (no prebuilt module and no compiler, a failed build)."""
    import torch

    name = build.name
    if name in LOADED:
        return
    path = prebuilt_path(build)
    if path is not None:
        torch.ops.load_library(str(path))
        LOADED[name] = "prebuilt"
        return
    _jit_build(build)
    LOADED[name] = "jit"


def _jit_build(build: KernelBuild) -> None:
    """The first-use build (an edited source, or a package built without kernels)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    logger.info("building %s (no installed build of these sources)", build.name)
    load(
        name=build.name,
        sources=[str(build.path)],
        extra_cflags=list(build.cflags),
        # OpenMP: ATen's parallel_for is a header template, compiled into the kernel; without
        # it the kernel runs on one thread. libgomp.so.1 resolves to the one torch loaded.
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package's binary is not there unless the
    environment is activated."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_or_fall_back(
    compile_fn: Callable[[str], Any],
    source_name: str,
    what: str,
    fallback: str,
    isa: str | None,
    lowest: str = "avx2",
) -> Any | None:
    """`compile_fn(isa)` where TIDEPOOL_CPU_ATTENTION allows it and `isa` (a build, chosen by
    the caller with cpu_features.best) is not None, else None with one warning line (`what` is
    off, `fallback` runs instead); `=native` makes a failed build an error. Shared by the
    encoder attention kernel, the decoder kernels and the int8 kernels."""
    mode = envs.cpu_attention()
    if mode == "sdpa":
        return None
    why = cpu_features.why_not(lowest) if isa is None else ""
    if isa is not None:
        try:
            return compile_fn(isa)
        except Exception as e:  # no installed build and no compiler / ninja, a failed build
            why = f"building {source_name} for {isa} failed: {type(e).__name__}: {e}"
    if mode == "native":
        raise RuntimeError(f"TIDEPOOL_CPU_ATTENTION=native, but {what} is unusable: {why}")
    logger.warning("%s is off (%s); using %s", what, why, fallback)
    return None
