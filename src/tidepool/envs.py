"""Every environment variable tidepool reads, in one place."""

from __future__ import annotations

import os
import sys


def device() -> str | None:
    """TIDEPOOL_DEVICE: force a torch device ("cpu", "cuda:1"); default: CUDA when present."""
    return os.environ.get("TIDEPOOL_DEVICE") or None


def num_threads() -> int | None:
    """TIDEPOOL_NUM_THREADS: torch intra-op threads; default: all the cores this process may use."""
    value = os.environ.get("TIDEPOOL_NUM_THREADS")
    return int(value) if value else None


def api_key() -> str | None:
    """TIDEPOOL_API_KEY: the server's API key when `tidepool serve` gets no --api-key."""
    return os.environ.get("TIDEPOOL_API_KEY") or None


def cache_dir() -> str:
    """TIDEPOOL_CACHE_DIR: where tidepool keeps what it builds (the example models); default:
    $XDG_CACHE_HOME/tidepool, else ~/.cache/tidepool."""
    explicit = os.environ.get("TIDEPOOL_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidepool")


def cpu_attention() -> str:
    """TIDEPOOL_CPU_ATTENTION: the encoders' attention kernel on CPU. "auto" (default): tidepool's
    own kernel (its AVX-512 or AVX2 build, cpu_isa) where the CPU has one and it builds, else
    PyTorch's SDPA; "native": the
    own kernel or an error saying why not; "sdpa": always PyTorch's SDPA."""
    value = (os.environ.get("TIDEPOOL_CPU_ATTENTION") or "auto").lower()
    if value not in ("auto", "native", "sdpa"):
        raise ValueError(f"TIDEPOOL_CPU_ATTENTION must be auto, native or sdpa, got {value!r}")
    return value


CPU_ISAS = ("auto", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx")
"""TIDEPOOL_CPU_ISA's values: "auto" and kernels/cpu_features.py's LEVELS, ascending."""


def cpu_isa() -> str:
    """TIDEPOOL_CPU_ISA: the highest instruction-set level tidepool's CPU kernels may use, as
    oneDNN's ONEDNN_MAX_CPU_ISA caps oneDNN's (kernels/cpu_features.py): "avx2" runs the AVX2
    builds on an AVX-512 CPU, "avx512" keeps the AMX paths off. "auto" (default): no cap. A cap
    above what the CPU has changes nothing; torch's own oneDNN is not capped by it."""
    value = (os.environ.get("TIDEPOOL_CPU_ISA") or "auto").lower()
    if value not in CPU_ISAS:
        raise ValueError(f"TIDEPOOL_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {value!r}")
    return value


def int8_gemm() -> str:
    """TIDEPOOL_INT8_GEMM: the int8 linears' GEMM. "auto" (default): tidepool's AMX kernel with
    the epilogue in its tile loop where the CPU has AMX-INT8 and the shape fits (K % 64, N % 32),
    else its VNNI kernel where the CPU has AVX-512 VNNI or AVX-VNNI (K % 4, N % 16), else
    oneDNN's int8 matmul and tidepool's epilogue kernels; "onednn": always the latter."""
    value = (os.environ.get("TIDEPOOL_INT8_GEMM") or "auto").lower()
    if value not in ("auto", "onednn"):
        raise ValueError(f"TIDEPOOL_INT8_GEMM must be auto or onednn, got {value!r}")
    return value


def int8_two_part() -> str | None:
    """TIDEPOOL_INT8_TWO_PART: which weights the int8 mode's sensitive linears (QKV, FFN up and
    down) get, replacing the `two_part` of whatever recipe is in use; None (unset): the
    recipe's own (the default's: "auto"). "auto": two-part (~15-bit, two int8 GEMMs) only when
    one-part weights leave the load check's error above quantization/int8.py's
    MAX_ONE_PART_ERROR (the level that keeps ~0.95 top-10 retrieval overlap with float32);
    "always"; "never" (one GEMM per linear: fastest, cos ~0.999 but less retrieval overlap on
    models with outlier channels)."""
    value = (os.environ.get("TIDEPOOL_INT8_TWO_PART") or "").lower()
    if not value:
        return None
    if value not in ("auto", "always", "never"):
        raise ValueError(f"TIDEPOOL_INT8_TWO_PART must be auto, always or never, got {value!r}")
    return value


def cpu_attention_matmul() -> str:
    """TIDEPOOL_CPU_ATTENTION_MATMUL: the products (Q·Kᵀ, P·V) of the CPU attention kernel for
    the models that allow reduced precision (dtype bfloat16, quantization="int8"; float32 models
    always keep float32). "auto" (default): the measured choice (attention/backend.py);
    "float32", "bf16" or "bf16x3" (AMX-bf16 tiles, where the CPU has them)."""
    value = (os.environ.get("TIDEPOOL_CPU_ATTENTION_MATMUL") or "auto").lower()
    if value not in ("auto", "float32", "bf16", "bf16x3"):
        raise ValueError(
            f"TIDEPOOL_CPU_ATTENTION_MATMUL must be auto, float32, bf16 or bf16x3, got {value!r}"
        )
    return value


def apply_openmp_defaults() -> bool:
    """OMP_WAIT_POLICY: tidepool sets PASSIVE with a short spin (SPIN_COUNT) unless the user
    chose a policy; returns whether PASSIVE applies.

    With the default (spinning) policy, an OpenMP thread that waits at a barrier burns its core;
    when the machine is shared, the thread it waits for is then descheduled and every parallel
    region pays a scheduler time slice; large GEMMs are no slower passive (docs/performance.md,
    "Choices in the encoder path"). OpenMP reads the variable when torch loads, so this must run before `import torch`.
    """
    global _OPENMP_DEFAULTS_MISSED
    if "torch" in sys.modules:
        _OPENMP_DEFAULTS_MISSED = "OMP_WAIT_POLICY" not in os.environ
        return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    return os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE"


_OPENMP_DEFAULTS_MISSED = False


def openmp_defaults_missed() -> bool:
    """Whether torch (so libgomp) loaded before tidepool with no OMP_WAIT_POLICY set: OpenMP then
    keeps libgomp's own spinning wait, which tidepool cannot change any more (libgomp reads its
    variables once, when it loads). The engine warns once (engine/llm_engine.py): on a shared
    machine that wait is several times slower (docs/performance.md, "Under contention")."""
    return _OPENMP_DEFAULTS_MISSED


SPIN_COUNT = 1_000
"""GOMP_SPINCOUNT set with tidepool's PASSIVE default: a thread at a barrier spins this many
rounds before it sleeps. Chosen on the shared (loaded) 2-core machine with
benchmarks/contention.py, the policies interleaved pass by pass: 1,000 rounds kept more of the
throughput than the 10,000 before it, quiet and with a core taken; 0 was faster still there,
but a short spin saves the wake-up between the short ops of a quiet machine
(docs/performance.md, "Under contention")."""


def onednn_cache_capacity() -> int | str:
    """TIDEPOOL_ONEDNN_CACHE_CAPACITY: entries in each of oneDNN's shape-keyed primitive caches
    (worker/memory.py). "auto" (default): 256 for float32 models, torch's 1,024 for bfloat16 /
    float16 (their AMX primitives take milliseconds to build), with the heap trimmed after
    steps; a count: that many, trimmed; "torch": torch's 1,024 and no trimming (memory then
    grows with every new step shape)."""
    value = (os.environ.get("TIDEPOOL_ONEDNN_CACHE_CAPACITY") or "auto").lower()
    if value in ("auto", "torch"):
        return value
    if not value.isdigit():
        raise ValueError(
            f"TIDEPOOL_ONEDNN_CACHE_CAPACITY must be auto, torch or a count, got {value!r}"
        )
    return int(value)


# Hugging Face Hub variables (huggingface_hub's own names). huggingface_hub reads them once, when
# it is imported; tidepool reads them at each model lookup, so a change after import counts too.


def hf_hub_offline() -> bool | None:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE): "1" / "true": a model id comes from a local
    folder, the Hugging Face cache or a package, never from the Hub; None when neither is set."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value is None or value == "":
        return None
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hf_endpoint() -> str | None:
    """HF_ENDPOINT: the Hub's address (a mirror, a test server); None: huggingface_hub's."""
    value = os.environ.get("HF_ENDPOINT")
    return value.rstrip("/") if value else None


def hf_token() -> str | None:
    """HF_TOKEN: the Hub token when none is given (hf_token= / --hf-token); None: huggingface_hub
    falls back to the token saved by `hf auth login`."""
    return os.environ.get("HF_TOKEN") or None


def hf_hub_cache() -> str | None:
    """HF_HUB_CACHE (or HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub: the Hugging Face cache;
    None: huggingface_hub's default (~/.cache/huggingface/hub)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = os.environ.get("HF_HOME")
    return os.path.join(os.path.expanduser(home), "hub") if home else None


# vLLM's media variables (their vLLM names and defaults).


def image_fetch_timeout_s() -> float:
    """VLLM_IMAGE_FETCH_TIMEOUT: seconds an http(s) image's whole download may take (default 5,
    vLLM's); ValueError for a value that is not a positive number."""
    value = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT")
    if value is None or value.strip() == "":
        return 5.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"VLLM_IMAGE_FETCH_TIMEOUT={value!r}: give a number of seconds > 0")
    return seconds


def media_url_allow_redirects() -> bool:
    """VLLM_MEDIA_URL_ALLOW_REDIRECTS: "0" / "false": an image URL that redirects fails; default:
    redirects are followed (each hop checked like the first URL)."""
    value = os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1")
    return value.strip().lower() not in ("0", "false", "no", "off")
