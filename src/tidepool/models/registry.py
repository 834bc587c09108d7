"""Architecture name → model class (imported lazily), and building a model with its weights."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from tidepool.config import ModelConfig
from tidepool.models.loader import iter_weights

# architecture → (module under tidepool.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    # Causal decoders: the bare body embeds (LAST pooling), *ForCausalLM adds the LM head.
    "LlamaModel": ("llama", "LlamaModel"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("llama", "MistralModel"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2Model": ("llama", "Qwen2Model"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3Model": ("llama", "Qwen3Model"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
}


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
    model_cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = model_cls(config.hf_config)
    model = model.to_empty(device="cpu").to(torch.float32)
    model.load_weights(iter_weights(config.path))
    model = model.to(device=config.device, dtype=config.dtype)
    model.eval().requires_grad_(False)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model
