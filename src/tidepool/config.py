"""Engine configuration: built once from the entry point's arguments, read-only afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidepool import envs
from tidepool.models.loader import (
    SentenceTransformersMeta,
    load_sentence_transformers_meta,
    resolve_model_path,
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# Architectures whose positions start after padding_idx (RoBERTa family).
_ROBERTA_LIKE = ("Roberta", "XLMRoberta", "Camembert")


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        # float32 on CPU matches the reference to 1e-6; bfloat16 is opt-in (dtype="bfloat16").
        return torch.float32
    if hf_dtype in (torch.float16, torch.bfloat16):
        return hf_dtype
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """The name the user gave (a folder or a model id)."""
    path: Path
    """The folder the model was found in."""
    hf_config: Any
    """transformers' PretrainedConfig of the model."""
    architecture: str
    """The architecture we build (after `convert`)."""
    task: str
    """"embed", "classify" (pooling runner) or "generate" (sampling runner)."""
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    """Longest prompt in tokens (special tokens included)."""
    st: SentenceTransformersMeta
    """sentence-transformers metadata (pooling mode, Dense, Normalize, prompts)."""
    seed: int = 0
    is_causal: bool = False
    """Causal (decoder) attention: the model keeps a paged KV cache, chunked prefill and prefix
    caching apply. False for bidirectional encoders, which run each prompt whole in one step."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids from generation_config.json (else config.json); generation stops there."""
    model_impl: str = "native"
    """ "native" (tidepool's model code) or "transformers" (Hugging Face's modeling code with
    tidepool's attention: models/transformers_backend.py)."""
    trust_remote_code: bool = False
    """The transformers backend may run modeling code shipped in the model folder."""

    def __post_init__(self) -> None:
        if isinstance(self.max_model_len, bool) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def runner_type(self) -> str:
        """ "generate" (hidden states → logits → sampler) or "pooling" (→ pooler)."""
        return "generate" if self.task == "generate" else "pooling"

    @property
    def num_labels(self) -> int:
        return int(getattr(self.hf_config, "num_labels", 1))

    @property
    def is_cross_encoder(self) -> bool:
        return self.task == "classify"

    @property
    def uses_token_type_ids(self) -> bool:
        return int(getattr(self.hf_config, "type_vocab_size", 0) or 0) > 1


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 16384
    """Token budget of one engine step (sum of scheduled tokens)."""
    max_num_seqs: int = 256
    """Most sequences in one engine step."""
    enable_chunked_prefill: bool = True
    """Causal models: a prompt longer than the step's remaining budget runs over several steps
    (mixed with decoding requests). Encoders always run a prompt whole."""
    long_prefill_token_threshold: int = 0
    """Causal models with chunked prefill: most prompt tokens one request runs in one step (vLLM's
    setting of that name); 0: no cap beyond the step's budget. A hybrid KV cache frees the blocks
    that leave a sliding window after each chunk, so smaller chunks keep fewer blocks in flight."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


# KV-cache budget on CPU when none is given: vLLM's VLLM_CPU_KVCACHE_SPACE default, at most a
# quarter of the memory available now. The engine caps it further at what max_num_seqs requests
# of max_model_len tokens can use, so small models take little of it.
CPU_DEFAULT_KV_CACHE_BYTES = 4 << 30
CPU_DEFAULT_KV_CACHE_SHARE = 0.25
# On a GPU, the share of its memory the whole process may use (vLLM's gpu_memory_utilization).
GPU_DEFAULT_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache of causal models (encoders keep none)."""

    block_size: int = 16
    """Tokens per KV block (and per prefix-cache hash)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token prefix was computed before (chained hashes)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache. None: `memory_fraction` where given, else on CPU 4 GiB (at most a
    quarter of the available memory) and on a GPU a 0.9 memory fraction."""
    memory_fraction: float | None = None
    """Share of the device's total memory the whole process may use; the KV cache gets what the
    loaded model leaves of it (vLLM's gpu_memory_utilization)."""
    disable_hybrid_kv_cache_manager: bool = False
    """Sliding-window layers keep every block like full attention (one group where head shapes
    agree): the uniform layout, the baseline the hybrid one is measured against (vLLM's name)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.memory_fraction is not None:
            raise ValueError("give kv_cache_memory_bytes or memory_fraction, not both")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")

    def budget(self, device: torch.device) -> tuple[int | None, float | None]:
        """(kv_cache_memory_bytes, memory_fraction) for `plan_kv_cache`: exactly one is set."""
        if self.kv_cache_memory_bytes is not None or self.memory_fraction is not None:
            return self.kv_cache_memory_bytes, self.memory_fraction
        if device.type == "cpu":
            from tidepool.kv_cache.spec import device_memory_bytes

            available, _ = device_memory_bytes(device)
            return min(
                CPU_DEFAULT_KV_CACHE_BYTES, int(available * CPU_DEFAULT_KV_CACHE_SHARE)
            ), None
        return None, GPU_DEFAULT_MEMORY_FRACTION


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    scheduler: SchedulerConfig
    cache: CacheConfig = field(default_factory=CacheConfig)


# Causal LMs whose body is not named <prefix>Model (Gemma3Model is the multimodal model).
_CAUSAL_LM_BODIES = {"Gemma3ForCausalLM": "Gemma3TextModel"}


def _base_architecture(arch: str) -> str:
    if arch in _CAUSAL_LM_BODIES:
        return _CAUSAL_LM_BODIES[arch]
    for suffix in (
        "ForSequenceClassification",
        "ForMaskedLM",
        "ForTokenClassification",
        "ForCausalLM",
    ):
        if arch.endswith(suffix):
            return arch[: -len(suffix)] + "Model"
    return arch


def _resolve_task(
    arch: str, runner: str, convert: str, model_impl: str = "native"
) -> tuple[str, str]:
    """(task, architecture to build) from the checkpoint's architecture and the user's choice.

    *ForCausalLM generates unless a pooling runner or a convert is asked for (then its body
    embeds, e.g. e5-mistral); *ForSequenceClassification classifies; anything else embeds.
    """
    from tidepool.models.registry import has_implementation

    if runner == "generate":
        if convert != "auto":
            raise ValueError(f"convert={convert!r} applies to pooling runners, not 'generate'")
        causal_lm = arch if arch.endswith("ForCausalLM") else None
        if causal_lm is None and arch.endswith("Model"):
            lms = {body: lm for lm, body in _CAUSAL_LM_BODIES.items()}
            causal_lm = lms.get(arch, arch.removesuffix("Model") + "ForCausalLM")
        if causal_lm is None or not has_implementation(causal_lm, model_impl):
            raise ValueError(
                f"runner='generate' is not available for {arch}: it has no language-model head "
                "in tidepool (generative architectures: *ForCausalLM of Llama, Mistral, Qwen2, "
                "Qwen3, Gemma2, Gemma3; other *ForCausalLM of transformers with model_impl auto "
                "or transformers)"
            )
        return "generate", causal_lm
    is_classifier = arch.endswith("ForSequenceClassification")
    if convert == "embed":
        return "embed", _base_architecture(arch)
    if convert == "classify":
        if not is_classifier:
            raise ValueError(
                f"convert='classify' needs a model with a classification head; {arch} has none"
            )
        return "classify", arch
    if is_classifier:
        return "classify", arch
    if arch.endswith("ForCausalLM") and runner == "auto":
        return "generate", arch
    return "embed", _base_architecture(arch)


def _eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list), else config.json's."""
    value = None
    gen_config = path / "generation_config.json"
    if gen_config.is_file():
        value = json.loads(gen_config.read_text(encoding="utf-8")).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def build_model_config(
    model: str,
    *,
    convert: str = "auto",
    runner: str = "auto",
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    device: str | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    model_impl: str = "auto",
) -> ModelConfig:
    from transformers import AutoConfig

    from tidepool.models.registry import get_model_class, resolve_model_impl

    if runner not in ("auto", "pooling", "generate"):
        raise ValueError(f"runner must be auto, pooling or generate, got {runner!r}")
    if convert not in ("auto", "embed", "classify"):
        raise ValueError(f"convert must be auto, embed or classify, got {convert!r}")
    path = resolve_model_path(model)
    hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        archs = [f"{type(hf_config).__name__.removesuffix('Config')}Model"]
    task, arch = _resolve_task(archs[0], runner, convert, model_impl)
    impl = resolve_model_impl(arch, model_impl)
    position_offset = None
    if impl == "transformers":
        from tidepool.models.transformers_backend import inspect_hf_model

        info = inspect_hf_model(arch, task, hf_config, path, trust_remote_code)
        is_causal, position_offset = info.is_causal, info.position_offset
    else:
        is_causal = bool(getattr(get_model_class(arch), "is_causal", False))

    st = load_sentence_transformers_meta(path)
    dev = torch.device(device) if device else _default_device()
    # transformers 5 names it `dtype`, 4.x `torch_dtype` (reading the old name warns in 5).
    hf_dtype = hf_config.__dict__.get("dtype", hf_config.__dict__.get("torch_dtype"))
    torch_dtype = _resolve_dtype(dtype, dev, hf_dtype)

    derived = int(getattr(hf_config, "max_position_embeddings", 512))
    if position_offset is not None:
        derived -= position_offset  # the transformers backend read it from the model
    elif any(arch.startswith(p) for p in _ROBERTA_LIKE):
        pad = getattr(hf_config, "pad_token_id", None)
        derived -= (1 if pad is None else int(pad)) + 1  # positions start after padding_idx
    if st.max_seq_length is not None:
        derived = min(derived, st.max_seq_length)
    if max_model_len is None:
        max_model_len = derived
    elif max_model_len > derived:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model allows ({derived} tokens)"
        )
    return ModelConfig(
        model=str(model),
        path=path,
        hf_config=hf_config,
        architecture=arch,
        task=task,
        dtype=torch_dtype,
        device=dev,
        max_model_len=int(max_model_len),
        st=st,
        seed=seed,
        is_causal=is_causal,
        eos_token_ids=_eos_token_ids(path, hf_config),
        model_impl=impl,
        trust_remote_code=trust_remote_code,
    )


def _default_device() -> torch.device:
    forced = envs.device()
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
