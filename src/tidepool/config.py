"""Engine configuration: built once from the entry point's arguments, read-only afterwards."""

from __future__ import annotations

from dataclasses import dataclass
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
    """"embed" or "classify": what the model's head computes."""
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    """Longest prompt in tokens (special tokens included)."""
    st: SentenceTransformersMeta
    """sentence-transformers metadata (pooling mode, Dense, Normalize, prompts)."""
    seed: int = 0

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

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    scheduler: SchedulerConfig


def _base_architecture(arch: str) -> str:
    for suffix in ("ForSequenceClassification", "ForMaskedLM", "ForTokenClassification"):
        if arch.endswith(suffix):
            return arch[: -len(suffix)] + "Model"
    return arch


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
) -> ModelConfig:
    from transformers import AutoConfig

    if runner not in ("auto", "pooling"):
        raise ValueError(
            f"runner={runner!r} is not available yet; this build runs pooling models "
            "(runner='auto' or 'pooling')"
        )
    if convert not in ("auto", "embed", "classify"):
        raise ValueError(f"convert must be auto, embed or classify, got {convert!r}")
    path = resolve_model_path(model)
    hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        archs = [f"{type(hf_config).__name__.removesuffix('Config')}Model"]
    arch = archs[0]
    is_classifier = arch.endswith("ForSequenceClassification")
    if convert == "embed":
        task = "embed"
        arch = _base_architecture(arch)
    elif convert == "classify":
        if not is_classifier:
            raise ValueError(
                f"convert='classify' needs a model with a classification head; {arch} has none"
            )
        task = "classify"
    else:
        task = "classify" if is_classifier else "embed"
        if not is_classifier:
            arch = _base_architecture(arch)

    st = load_sentence_transformers_meta(path)
    dev = torch.device(device) if device else _default_device()
    # transformers 5 names it `dtype`, 4.x `torch_dtype` (reading the old name warns in 5).
    hf_dtype = hf_config.__dict__.get("dtype", hf_config.__dict__.get("torch_dtype"))
    torch_dtype = _resolve_dtype(dtype, dev, hf_dtype)

    derived = int(getattr(hf_config, "max_position_embeddings", 512))
    if any(arch.startswith(p) for p in _ROBERTA_LIKE):
        derived -= int(getattr(hf_config, "pad_token_id", 1) or 1) + 1
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
    )


def _default_device() -> torch.device:
    forced = envs.device()
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
