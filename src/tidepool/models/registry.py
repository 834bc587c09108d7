"""Architecture name → model class (imported lazily), and building a model with its weights."""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from tidepool.config import ModelConfig
from tidepool.models.interfaces import ExtraWeightFiles, attach_attention_backend
from tidepool.models.loader import iter_weights

# architecture → (module under tidepool.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    # Heads the pooler runs per token (models/heads.py): SPLADE's MLM head, BGE-M3, NER.
    "BertForMaskedLM": ("heads", "BertForMaskedLM"),
    "RobertaForMaskedLM": ("heads", "RobertaForMaskedLM"),
    "XLMRobertaForMaskedLM": ("heads", "XLMRobertaForMaskedLM"),
    "BgeM3EmbeddingModel": ("heads", "BgeM3EmbeddingModel"),
    "BertForTokenClassification": ("heads", "BertForTokenClassification"),
    "RobertaForTokenClassification": ("heads", "RobertaForTokenClassification"),
    "XLMRobertaForTokenClassification": ("heads", "XLMRobertaForTokenClassification"),
    # BERT-like layers with a bucketed relative position bias.
    "MPNetModel": ("mpnet", "MPNetModel"),
    "MPNetForSequenceClassification": ("mpnet", "MPNetForSequenceClassification"),
    # Pre-norm encoders with T5's bucketed relative position bias (sentence-t5, GTR).
    "T5EncoderModel": ("t5", "T5EncoderModel"),
    "MT5EncoderModel": ("t5", "MT5EncoderModel"),
    # Disentangled attention (content and relative-position terms), on padded buckets.
    "DebertaV2Model": ("deberta_v2", "DebertaV2Model"),
    "DebertaV2ForSequenceClassification": ("deberta_v2", "DebertaV2ForSequenceClassification"),
    "DebertaV2ForTokenClassification": ("deberta_v2", "DebertaV2ForTokenClassification"),
    # Causal decoders: the bare body embeds (LAST pooling), *ForCausalLM adds the LM head.
    "LlamaModel": ("llama", "LlamaModel"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("llama", "MistralModel"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2Model": ("llama", "Qwen2Model"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3Model": ("llama", "Qwen3Model"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    # Causal decoders with a classification head on the last token (LLM rerankers).
    "LlamaForSequenceClassification": ("causal_classifier", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("causal_classifier", "MistralForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("causal_classifier", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("causal_classifier", "Qwen3ForSequenceClassification"),
    # Hybrid sliding-window / full attention: two KV-cache groups in one block pool.
    "Gemma2Model": ("gemma", "Gemma2Model"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3TextModel": ("gemma", "Gemma3TextModel"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    # EmbeddingGemma: Gemma3TextModel with use_bidirectional_attention (see native_architecture).
    "Gemma3TextEncoderModel": ("gemma_embed", "Gemma3TextEncoderModel"),
}

# Architectures whose checkpoints may set `use_bidirectional_attention` (a decoder trained as an
# encoder): with the flag the native model is this registered encoder, run without a KV cache.
_BIDIRECTIONAL_VARIANTS: dict[str, str] = {"Gemma3TextModel": "Gemma3TextEncoderModel"}


MODEL_IMPLS = ("auto", "native", "transformers", "fallback")
"""auto: the native model when there is one, else the transformers backend, else (for pooling
tasks, when the backend cannot plug its attention in) the fallback: the HF model as it is,
unpacked (models/fallback.py). transformers: the backend or an error (strict)."""


def resolve_model_impl(architecture: str, model_impl: str) -> str:
    """ "native", "transformers" or "fallback": the first code to try for `architecture` (auto's
    step from the backend to the fallback happens in models/resolve.py, which inspects the model)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    if model_impl == "auto":
        return "native" if is_registered(architecture) else "transformers"
    if model_impl == "native":
        get_model_class(architecture)  # raises, listing the native architectures
    return model_impl


def has_implementation(architecture: str, model_impl: str) -> bool:
    """Some code can build `architecture` under `model_impl` (without remote code)."""
    if model_impl not in ("transformers", "fallback") and is_registered(architecture):
        return True
    if model_impl == "native":
        return False
    from tidepool.models.transformers_backend import has_hf_class

    return has_hf_class(architecture)


def native_architecture(architecture: str, hf_config: object) -> str:
    """The registered architecture that runs `architecture` with this config natively: its
    bidirectional variant when the config asks for one, else itself."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        return _BIDIRECTIONAL_VARIANTS.get(architecture, architecture)
    return architecture


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_registered(architecture: str) -> bool:
    return architecture in _MODELS


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        module_name, class_name = _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} has no implementation in tidepool yet; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None
    module = importlib.import_module(f"tidepool.models.{module_name}")
    return getattr(module, class_name)


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate without initializing (meta device), then fill from the checkpoint."""
    if config.model_impl == "transformers":
        from tidepool.models.transformers_backend import build_transformers_model

        return build_transformers_model(config)
    if config.model_impl == "fallback":
        from tidepool.models.fallback import build_fallback_model

        return build_fallback_model(config)
    model_cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = model_cls(config.hf_config)
    model = model.to_empty(device="cpu").to(torch.float32)
    weights = iter_weights(config.path)
    if isinstance(model, ExtraWeightFiles):
        weights = itertools.chain(weights, _extra_weights(config.path, model.extra_weight_files))
    model.load_weights(weights)
    model = model.to(device=config.device, dtype=config.dtype)
    model.eval().requires_grad_(False)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    # Once device and dtype are final: a machine's first run builds the CPU kernel now.
    attach_attention_backend(model, config.device, config.dtype)
    if config.quantization == "int8":
        from tidepool.models.quantization import calibration_sequences, quantize_model

        sequences = calibration_sequences(
            config.path, config.max_model_len, config.hf_config.vocab_size, config.seed
        )
        if quantize_model(model, sequences).passed:
            # Calibrated and checked on float32 attention; the int8 model's may be reduced.
            attach_attention_backend(model, config.device, config.dtype, reduced_precision=True)
    return model


def _extra_weights(folder: Path, files: Mapping[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of state-dict files beside the checkpoint, named with their prefixes."""
    for file_name, prefix in files.items():
        path = folder / file_name
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {file_name} (this model's head needs it)")
        state = torch.load(str(path), map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            yield prefix + name, tensor
