"""Architecture name → model class (imported lazily), and building a model with its weights."""

from __future__ import annotations

import copy
import importlib
import itertools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tidepool.checkpoint.loader import iter_weights
from tidepool.config import ModelConfig
from tidepool.models.interfaces import ExtraWeightFiles, attach_attention_backend
from tidepool.models.quantizable import has_int8_path

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
    # Qwen2-VL: the vision tower's image rows at the placeholders, Qwen2 with M-RoPE (embedders).
    "Qwen2VLModel": ("qwen2_vl", "Qwen2VLModel"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "ColQwen2ForRetrieval": ("colqwen2", "ColQwen2ForRetrieval"),
    # PaliGemma (SigLIP's patches at the <image> tokens, Gemma bidirectional) + projection.
    "ColPaliForRetrieval": ("colpali", "ColPaliForRetrieval"),
    # Hybrid sliding-window / full attention: two KV-cache groups in one block pool.
    "Gemma2Model": ("gemma", "Gemma2Model"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3TextModel": ("gemma", "Gemma3TextModel"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    # EmbeddingGemma: Gemma3TextModel with use_bidirectional_attention (see native_architecture).
    "Gemma3TextEncoderModel": ("gemma_embed", "Gemma3TextEncoderModel"),
    # Dual towers (text and images into one space): models/interfaces.py DualTowerModel.
    "CLIPModel": ("clip", "CLIPModel"),
    "CLIPVisionModelWithProjection": ("clip", "CLIPVisionModelWithProjection"),
    "SiglipModel": ("siglip", "SiglipModel"),
    "SiglipVisionModel": ("siglip", "SiglipVisionModel"),
    "Siglip2Model": ("siglip2", "Siglip2Model"),
}

# Architectures whose checkpoints may set `use_bidirectional_attention` (a decoder trained as an
# encoder): with the flag the native model is this registered encoder, run without a KV cache.
_BIDIRECTIONAL_VARIANTS: dict[str, str] = {"Gemma3TextModel": "Gemma3TextEncoderModel"}


MODEL_IMPLS = ("auto", "native", "transformers", "fallback")
"""auto: the native model when there is one, else the transformers backend, else (for pooling
tasks, when the backend cannot plug its attention in) the fallback: the HF model as it is,
unpacked (transformers_backend/fallback.py). transformers: the backend or an error (strict)."""


def resolve_model_impl(architecture: str, model_impl: str) -> str:
    """ "native", "transformers" or "fallback": the first code to try for `architecture` (auto's
    step from the backend to the fallback happens in model_loader/resolve.py, which inspects the model)."""
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
    from tidepool.transformers_backend.backend import has_hf_class

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


def int8_architectures() -> list[str]:
    """The native architectures whose class declares an int8 layout (models/quantizable.py)."""
    return [a for a in _MODELS if has_int8_path(get_model_class(a))]


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate without initializing (meta device), then fill from the checkpoint."""
    if config.model_impl == "transformers":
        from tidepool.transformers_backend.backend import build_transformers_model

        return build_transformers_model(config)
    if config.model_impl == "fallback":
        from tidepool.transformers_backend.fallback import build_fallback_model

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
        from tidepool.quantization.int8 import calibration_sequences, quantize_model, recipe_for

        sequences = calibration_sequences(
            config.path, config.max_model_len, config.hf_config.vocab_size, config.seed
        )
        if quantize_model(model, sequences, recipe_for(model)).passed:
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


# ----------------------------------------------------------------------------- what cannot run

# model_type of a vision + text model → its text tower's class, which tidepool runs.
_TEXT_TOWERS = {"clip": "CLIPTextModelWithProjection"}
_TEXT_TOWER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection")
# model_type of an encoder-decoder → its encoder alone (tidepool's native T5 encoders).
_ENCODERS = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel"}
# model_type of remote code that transformers 5 has ported → what runs instead.
_PORTS = {
    "new": (
        "this is Alibaba's GTE code (NewModel). transformers 5 has its own port of it, GteModel "
        '(model_type "gte"), which runs on tidepool\'s transformers backend: use a checkpoint '
        "saved for GteModel"
    ),
}


def text_tower_config(hf_config: Any) -> Any:
    """hf_overrides={"architectures": ["CLIPTextModelWithProjection"]} on a CLIPModel folder: the
    text tower's config (its text_config, with the projection's width), so that the text tower
    alone loads from the whole model's checkpoint; any other config as it is."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    text = getattr(hf_config, "text_config", None)
    if not archs or archs[0] not in _TEXT_TOWER_CLASSES or text is None:
        return hf_config
    text = copy.deepcopy(text)
    text.architectures = archs
    if getattr(hf_config, "projection_dim", None) is not None:
        text.projection_dim = hf_config.projection_dim
    return text


def refuse_unsupported_kind(architecture: str, hf_config: Any, task: str) -> None:
    """A clear ValueError, before anything is built, for pooling models tidepool cannot run:
    vision / audio + text models and encoder-decoders, saying what runs instead."""
    if task == "generate" or is_registered(architecture):
        return
    model_type = getattr(hf_config, "model_type", None)
    others = [n for n in ("vision", "audio") if getattr(hf_config, f"{n}_config", None) is not None]
    if others:
        tower = _TEXT_TOWERS.get(model_type)
        if tower is not None:
            hint = (
                f'Its text tower alone runs as an embedding model: hf_overrides={{"architectures":'
                f' ["{tower}"]}} (the text embeddings of get_text_features)'
            )
        elif model_type == "siglip":
            hint = (
                "tidepool runs SigLIP checkpoints as SiglipModel (texts and images into one "
                'space: hf_overrides={"architectures": ["SiglipModel"]} on a whole-model '
                "checkpoint) or SiglipVisionModel (images alone)"
            )
        elif model_type == "siglip2":
            hint = "tidepool runs SigLIP 2 checkpoints as Siglip2Model (texts and images)"
        else:
            hint = "tidepool runs none of its towers alone yet"
        raise ValueError(
            f"{architecture} is a {' + '.join([*others, 'text'])} model: tidepool does not run "
            f"{' or '.join(others)} inputs yet (text models only). {hint}."
        )
    if getattr(hf_config, "is_encoder_decoder", False) and not architecture.endswith(
        "EncoderModel"
    ):
        encoder = _ENCODERS.get(model_type)
        hint = (
            f"Its encoder alone runs as an embedding model (MEAN pooling, as sentence-t5 / GTR): "
            f'hf_overrides={{"architectures": ["{encoder}"]}}'
            if encoder
            else "tidepool has no encoder-only model for it"
        )
        raise ValueError(
            f"{architecture} is an encoder-decoder model: tidepool runs encoders (embeddings, "
            f"scores) and decoders (generation), not the two together. {hint}."
        )


def port_hint(model_type: object) -> str:
    """ " <what runs instead>." for a remote-code model_type transformers has a port of, else ""."""
    port = _PORTS.get(model_type) if isinstance(model_type, str) else None
    return f" {port[0].upper()}{port[1:]}." if port else ""


def explain_config_error(path: Path, error: Exception, trust_remote_code: bool) -> Exception:
    """transformers' error for a config.json it cannot load, replaced where the folder's
    model_type is not a transformers model: what is wrong, what runs instead."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_file = Path(path) / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return error
    model_type = raw.get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return error
    archs = raw.get("architectures") or []
    what = f"model_type {model_type!r}" + (f" ({', '.join(archs)})" if archs else "")
    hint = port_hint(model_type)
    version = transformers.__version__
    auto_config = (raw.get("auto_map") or {}).get("AutoConfig")
    if auto_config is None:
        return ValueError(
            f"{path}: {what} is not a model of transformers {version}, and config.json has no "
            f"auto_map naming code that builds it, so nothing can load it.{hint}"
        )
    repository = auto_config.split("--")[0] if "--" in auto_config else None
    where = (
        f"code from another Hugging Face repository, {repository}, which tidepool does not "
        "download (it must be in the local cache)"
        if repository
        else "code shipped in the model folder"
    )
    if not trust_remote_code:
        return ValueError(
            f"{path}: {what} is not a model of transformers {version}; config.json's auto_map "
            f"builds it with {auto_config!r}, {where}. Pass trust_remote_code=True to run it "
            f"(only code you trust).{hint}"
        )
    return ValueError(
        f"{path}: {what} is not a model of transformers {version}, and its auto_map code "
        f"({auto_config!r}, {where}) could not be loaded ({type(error).__name__}).{hint}"
    )
