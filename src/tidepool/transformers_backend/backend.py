"""The transformers backend: Hugging Face modeling code with tidepool's attention plugged in.

For architectures without a native implementation (or with `model_impl="transformers"`):

    config.json ──▶ HF model class (transformers, or the folder's own code with trust_remote_code)
                ──▶ built with parameters on the meta device (no memory, no random init), buffers
                    real; parameters then allocated once on the target device and filled from the
                    checkpoint (iter_weights): the weights are never in memory twice
                ──▶ wrapped with the native models' contract:
                      encoders  forward(input_ids, positions, step metadata, token_type_ids)
                      decoders  forward(input_ids, positions, PagedAttentionMetadata, kv_caches)
                                + kv_cache_specs(block_size, dtype)
                      both      → hidden [num_tokens, hidden]; compute_logits(pooled or last states)

The flat batch goes in as one sequence [1, num_tokens] with our per-sequence positions as
position_ids; every attention layer calls `tidepool_attention` (transformers_attention.py), which
gets the step's metadata through the call's keyword arguments. Heads (classifiers, LM heads with
their scalings) run as HF wrote them: the HF model's own forward is called on the pooled states with
its body replaced by a stand-in that returns them (transformers_wrappers.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tidepool.checkpoint.loader import iter_weights, remote_code_refusal
from tidepool.config import ModelConfig
from tidepool.models.interfaces import attach_attention_backend
from tidepool.models.layers.linear import Linear
from tidepool.transformers_backend.attention import (
    ATTENTION_NAME,
    UnsupportedAttentionError,
    register_attention,
)
from tidepool.transformers_backend.wrappers import (
    EOS_POOLED_ENCODERS,
    TransformersDecoderModel,
    TransformersEncoderModel,
    TransformersEosPooledEncoder,
    attention_modules,
)

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
"""transformers versions the backend supports (tested on 5.24): 5.x hands the model call's keyword
arguments down to the attention functions, and its models declare `_supports_attention_backend`."""
_MIN_VERSION = (5, 0)

# task → (name of transformers' auto mapping from model_type to class name, auto_map key)
_AUTO_CLASSES: dict[str, tuple[str, str]] = {
    "embed": ("MODEL_MAPPING_NAMES", "AutoModel"),
    "classify": (
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForSequenceClassification",
    ),
    "generate": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
}


def check_transformers_version() -> None:
    import transformers

    version = transformers.__version__
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if major_minor < _MIN_VERSION:
        raise RuntimeError(
            f"the transformers backend needs transformers {SUPPORTED_TRANSFORMERS}, found "
            f"{version}: older versions do not pass keyword arguments down to attention "
            "functions. Upgrade transformers, or use a natively supported architecture."
        )


def has_hf_class(architecture: str) -> bool:
    """transformers itself defines `architecture` (no remote code needed)."""
    import transformers

    return isinstance(getattr(transformers, architecture, None), type)


def resolve_hf_class(
    architecture: str, task: str, hf_config: Any, path: Any, trust_remote_code: bool
) -> type[nn.Module]:
    """The HF class to build: transformers' own, else the model folder's code (auto_map).

    An embedding model needs the bare body only: a checkpoint saved with some head
    (BertLMHeadModel, ...) builds transformers' base class for its model_type.
    """
    import transformers
    from transformers.models.auto import modeling_auto

    mapping_name, auto_key = _AUTO_CLASSES[task]
    by_model_type = getattr(modeling_auto, mapping_name).get(getattr(hf_config, "model_type", None))
    own_embedding = task == "embed" and architecture in EOS_POOLED_ENCODERS  # CLIP's projection
    if has_hf_class(architecture) and (
        task != "embed" or architecture == by_model_type or own_embedding
    ):
        return getattr(transformers, architecture)
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if not has_hf_class(architecture) and auto_key in auto_map:
        if not trust_remote_code:
            entry = f"{auto_key} → {auto_map[auto_key]!r}"
            raise ValueError(remote_code_refusal(architecture, Path(path), entry))
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map[auto_key], str(path))
    if isinstance(by_model_type, str) and has_hf_class(by_model_type):
        return getattr(transformers, by_model_type)
    if has_hf_class(architecture):
        return getattr(transformers, architecture)
    raise ValueError(
        f"no implementation of {architecture} for task {task!r}: tidepool has no native one and "
        f"transformers {transformers.__version__} has no {auto_key} class for model_type "
        f"{getattr(hf_config, 'model_type', None)!r}"
    )


@dataclass(frozen=True)
class HFModelInfo:
    """What the engine configuration needs to know before the model is built."""

    hf_class: type[nn.Module]
    is_causal: bool
    position_offset: int
    """Added to our 0-based positions (RoBERTa-like models number them from padding_idx + 1)."""


def inspect_hf_model(
    architecture: str, task: str, hf_config: Any, path: Any, trust_remote_code: bool
) -> HFModelInfo:
    """Resolve and check the HF class (on the meta device: nothing allocated); raises a clear
    error for what the backend cannot run."""
    check_transformers_version()
    register_attention()
    hf_class = resolve_hf_class(architecture, task, hf_config, path, trust_remote_code)
    try:
        with torch.device("meta"):
            hf_model = hf_class(backend_config(hf_config))
    except KeyError as e:  # models that pick attention classes by name (Falcon, ...)
        if ATTENTION_NAME not in str(e):
            raise
        raise UnsupportedAttentionError(
            f"{hf_class.__name__} chooses its attention classes by implementation name instead "
            "of calling transformers' attention interface; tidepool's attention cannot be plugged in"
        ) from e
    structure = _check_structure(hf_model)
    return HFModelInfo(hf_class, structure.is_causal, _position_offset(hf_model.base_model))


def backend_config(hf_config: Any) -> Any:
    """A copy of the config (ModelConfig's stays untouched) that selects our attention."""
    config = copy.deepcopy(hf_config)
    config._attn_implementation = ATTENTION_NAME
    return config


# ----------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class _Structure:
    attention_modules: list[nn.Module]
    is_causal: bool


def _check_structure(hf_model: nn.Module) -> _Structure:
    name = type(hf_model).__name__
    if not getattr(hf_model, "_supports_attention_backend", False):
        raise UnsupportedAttentionError(
            f"{name} does not declare support for custom attention functions "
            "(_supports_attention_backend), so tidepool's attention cannot be plugged in"
        )
    recorded = getattr(hf_model, "_can_record_outputs", None) or {}
    cross = recorded.get("cross_attentions")
    cross_class = getattr(cross, "target_class", cross)
    if isinstance(cross_class, type) and any(
        isinstance(m, cross_class) for m in hf_model.modules()
    ):
        raise UnsupportedAttentionError(f"{name} has cross-attention, which is not supported")
    body = hf_model.base_model
    params = inspect.signature(body.forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise UnsupportedAttentionError(
            f"{type(body).__name__}.forward takes no **kwargs, so tidepool cannot pass its "
            "attention metadata to the attention layers"
        )
    if "position_ids" not in params:
        raise UnsupportedAttentionError(
            f"{type(body).__name__}.forward takes no position_ids; tidepool packs sequences "
            "and must give each token its position"
        )
    modules = attention_modules(hf_model)
    if not modules:
        raise UnsupportedAttentionError(f"found no attention layers in {name}")
    causal = {getattr(m, "is_causal", None) for m in modules}
    if causal not in ({True}, {False}):
        raise UnsupportedAttentionError(
            f"{name} mixes causal and bidirectional attention layers (or does not say which: "
            f"is_causal = {causal}); not supported"
        )
    return _Structure(modules, causal == {True})


def _position_offset(body: nn.Module) -> int:
    """padding_idx + 1 for RoBERTa-like embeddings (positions count from after the pad id)."""
    for module in body.modules():
        if hasattr(module, "create_position_ids_from_input_ids"):
            pad = getattr(module, "padding_idx", None)
            return 0 if pad is None else int(pad) + 1
    return 0


# ----------------------------------------------------------------------------- building


@contextlib.contextmanager
def _parameters_on_meta(dtype: torch.dtype) -> Iterator[None]:
    """While a model is constructed: parameters go to the meta device (no memory, their random
    init a no-op), buffers stay real, so the ones computed in __init__ (RoPE frequencies, position
    ids) keep their values; floating tensors default to `dtype`, as in from_pretrained.

    What accelerate's init_empty_weights(include_buffers=False) did (transformers 5 dropped it):
    nn.Module.register_parameter is patched for the duration, so do not build models on other
    threads meanwhile.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
        register(module, name, param)

    default_dtype = torch.get_default_dtype()
    nn.Module.register_parameter = register_on_meta
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        torch.set_default_dtype(default_dtype)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Meta parameters → uninitialized tensors on `device`; tied parameters stay one tensor."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in new:
                new[id(param)] = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=False
                )
            setattr(module, name, new[id(param)])
    model.to(device)  # the buffers


def _checkpoint_name_candidates(name: str, prefix: str) -> Iterator[str]:
    legacy = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
    for candidate in dict.fromkeys((name, legacy)):
        yield candidate
        if prefix and candidate.startswith(prefix + "."):
            yield candidate[len(prefix) + 1 :]  # a *For* checkpoint into the bare body
        elif prefix:
            yield f"{prefix}.{candidate}"  # a body checkpoint into a model with a head


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the parameters (and persistent buffers) they name; raises if a
    parameter is left without weights. Tied parameters are filled through either name."""
    targets = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") or ""
    loaded: set[int] = set()
    for ckpt_name, tensor in weights:
        name = next(
            (c for c in _checkpoint_name_candidates(ckpt_name, prefix) if c in targets), None
        )
        if name is None:
            continue
        target = targets[name]
        if target.shape != tensor.shape:
            raise ValueError(f"{ckpt_name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(id(target))
    missing = [name for name, param in model.named_parameters() if id(param) not in loaded]
    if missing:
        raise ValueError(
            f"the checkpoint has no weights for {len(missing)} parameters of "
            f"{type(model).__name__}: {missing[:8]}"
        )


def _weight_conversions(hf_model: nn.Module) -> list[Any]:
    """transformers' checkpoint conversions for this model, legacy gamma/beta names aside."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # older 5.x: no conversions
        return []
    return list(get_model_conversion_mapping(hf_model, add_legacy=False))


def build_transformers_model(
    config: ModelConfig,
    with_weights: bool = True,
    fill: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """The HF model for `config`, weights loaded, wrapped with the native models' contract;
    `with_weights=False`: nothing read from the checkpoint (a dry run's model), parameters
    uninitialized, or set by `fill(hf_model)` and the Linear layers left as HF's (the load-time
    check compares two runs of the same modules: packing them would only cost time)."""
    info = inspect_hf_model(
        config.architecture, config.task, config.hf_config, config.path, config.trust_remote_code
    )
    with _parameters_on_meta(config.dtype):
        hf_model = info.hf_class(backend_config(config.hf_config))
    if not with_weights:
        _materialize(hf_model, config.device)
        if fill is not None:
            fill(hf_model)
    elif _weight_conversions(hf_model):
        # Checkpoint tensors that transformers renames, splits or merges on load (NomicBERT's
        # fused Wqkv, ...): its own loader does that (also from the meta device, no copy).
        hf_model = info.hf_class.from_pretrained(
            str(config.path),
            config=backend_config(config.hf_config),
            attn_implementation=ATTENTION_NAME,
            dtype=config.dtype,
        ).to(config.device)
    else:
        _materialize(hf_model, config.device)
        load_hf_weights(hf_model, iter_weights(config.path))
    body = hf_model.base_model
    if config.task == "embed" and isinstance(getattr(body, "pooler", None), nn.Module):
        body.pooler = None  # BERT's pooler feeds classifiers only (add_pooling_layer=False)
    hf_model.eval().requires_grad_(False)
    if fill is None:
        _use_packed_linears(hf_model)
    model: TransformersDecoderModel | TransformersEncoderModel
    if info.is_causal:
        model = TransformersDecoderModel(hf_model, config)
    elif config.task == "embed" and type(hf_model).__name__ in EOS_POOLED_ENCODERS:
        model = TransformersEosPooledEncoder(hf_model, config, info.position_offset)
    else:
        model = TransformersEncoderModel(hf_model, config, info.position_offset)
    # Builds the CPU attention kernel now, if it runs here.
    attach_attention_backend(model, config.device, config.dtype)
    return model


class _FlatLinear(Linear):
    """tidepool's Linear (weight pre-packed for oneDNN on CPU) taking HF's [..., in] inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.dim() == 2:
            return super().forward(x)
        out = super().forward(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], self.out_features)


def _use_packed_linears(model: nn.Module) -> None:
    """Swap every plain nn.Linear for _FlatLinear on the same weight tensors (names unchanged).
    On CPU the packed GEMM is faster than F.linear (docs/performance.md, 'Choices in the encoder path')."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            with torch.device("meta"):
                packed = _FlatLinear(child.in_features, child.out_features, child.bias is not None)
            packed.weight = child.weight
            packed.bias = child.bias
            packed.process_weights_after_loading()
            setattr(parent, name, packed)
