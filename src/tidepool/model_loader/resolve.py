"""From what the user asked for to a ModelConfig: the checkpoint's folder and Hugging Face config,
the task and the architecture to build, which code builds it, dtype, device, longest prompt.

    model id ──▶ folder (loader) ──▶ config.json (AutoConfig) ──▶ architecture ──▶ (task, arch)
             ──▶ "native" or "transformers" (registry) ──▶ is_causal, position offset
             ──▶ + sentence-transformers files, dtype, device, max_model_len ──▶ ModelConfig

Everything that reads the checkpoint or probes the machine lives here, so config.py stays a leaf of
frozen dataclasses.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidepool.checkpoint.loader import (
    check_remote_code_config,
    load_sentence_transformers_meta,
    locate_model,
)
from tidepool.config import ModelConfig, SentenceTransformersMeta, SparseHeadConfig
from tidepool.model_loader.colbert import (
    COLBERT_IR_ARCHITECTURES,
    check_multi_vector_body,
    load_multi_vector,
)
from tidepool.model_loader.device_dtype import checkpoint_dtype, default_device, resolve_dtype
from tidepool.model_loader.pooling_choice import declares_st_pooling, log_pooling, log_st_embedder
from tidepool.model_loader.registry import (
    explain_config_error,
    get_model_class,
    has_implementation,
    int8_architectures,
    native_architecture,
    port_hint,
    refuse_unsupported_kind,
    resolve_model_impl,
    text_tower_config,
)
from tidepool.output_heads import Checkpoint, detect_head, get_head
from tidepool.quantization.int8 import check_quantization, check_quantization_target

RUNNERS = ("auto", "pooling", "generate")
CONVERTS = ("auto", "embed", "classify")

# Architectures whose positions start after padding_idx (RoBERTa family, MPNet).
_ROBERTA_LIKE = ("Roberta", "XLMRoberta", "Camembert", "MPNet")

# Causal LMs whose body is not named <prefix>Model (Gemma3Model is the multimodal model).
_CAUSAL_LM_BODIES = {"Gemma3ForCausalLM": "Gemma3TextModel"}

logger = logging.getLogger("tidepool")


@dataclass(frozen=True)
class ResolvedModel:
    """What runs: the task, the architecture, the code that builds it and what that code says."""

    task: str
    """"embed", "classify" or "generate"."""
    architecture: str
    """The architecture we build (after `convert`)."""
    model_impl: str
    """ "native", "transformers" or "fallback"."""
    is_causal: bool
    """Causal (decoder) attention."""
    position_offset: int | None
    """Added to 0-based positions, as the transformers backend read it from the model; None for
    native models (their offset follows from the architecture name)."""
    output_head: str = "task"
    """The output head's name (output_heads/): "task" unless the checkpoint called for one."""
    sparse: SparseHeadConfig | None = None
    """The sparse head's settings (SPLADE pooling, BGE-M3's skipped tokens)."""
    fallback_on_forward_error: bool = False
    """auto chose the transformers backend for an encoder: the load-time check decides whether
    the fallback runs it instead (transformers_backend/fallback.py: fallback_if_backend_fails)."""
    check_at_load: bool = False
    """The transformers backend runs an encoder: it proves itself at load (under
    model_impl="transformers" a disagreement is an error)."""


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
    hf_overrides: dict[str, Any] | None = None,
    quantization: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_token: str | bool | None = None,
) -> ModelConfig:
    """The ModelConfig of `model` (a folder, or a model id: cache, Hub or package, see
    checkpoint/loader.py); raises ValueError for a choice the model cannot run (a runner without a
    head, a dtype, a too long max_model_len). `hf_overrides` (vLLM's name) replaces keys of
    config.json's config before anything reads it."""
    from transformers import AutoConfig

    if runner not in RUNNERS:
        raise ValueError(f"runner must be auto, pooling or generate, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be auto, embed or classify, got {convert!r}")
    location = locate_model(
        model,
        revision=revision,
        download_dir=download_dir,
        hf_token=hf_token,
        trust_remote_code=trust_remote_code,
    )
    path = location.path
    try:
        check_remote_code_config(path, trust_remote_code)
    except ValueError as e:  # + what runs instead, where transformers has a port
        raise ValueError(f"{e}{port_hint(_read_model_type(path))}") from e
    try:
        hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as e:
        raise explain_config_error(path, e, trust_remote_code) from e
    if hf_overrides:
        hf_config.update(dict(hf_overrides))  # top-level keys, as vLLM's dict form
        hf_config = text_tower_config(hf_config)  # a CLIPModel folder's text tower alone
    resolved = resolve_model(hf_config, path, runner, convert, model_impl, trust_remote_code)
    st = load_sentence_transformers_meta(path)
    # A ColBERT checkpoint (colbert-ir or PyLate layout) is a multi-vector model: token_embed by
    # default, MaxSim scores (model_loader/colbert.py).
    multi_vector = None
    if resolved.task == "embed" and (
        found := load_multi_vector(path, _checkpoint_architecture(hf_config), st)
    ):
        multi_vector, st = found
        check_multi_vector_body(multi_vector, resolved.architecture, resolved.model_impl)
    if resolved.task == "embed" and resolved.output_head == "task" and multi_vector is None:
        log_pooling(resolved.architecture, resolved.model_impl, resolved.is_causal, st)
    torch_device = torch.device(device) if device else default_device()
    model_dtype = resolve_dtype(dtype, torch_device, checkpoint_dtype(hf_config))
    model_cls = None
    if quantization is not None and resolved.model_impl == "native":
        model_cls = get_model_class(resolved.architecture)
    check_quantization(
        quantization, resolved.architecture, resolved.model_impl, model_cls, int8_architectures
    )
    check_quantization_target(quantization, torch_device, model_dtype)
    config = ModelConfig(
        model=str(model),
        path=path,
        hf_config=hf_config,
        architecture=resolved.architecture,
        task=resolved.task,
        dtype=model_dtype,
        device=torch_device,
        max_model_len=_resolve_max_model_len(max_model_len, hf_config, resolved, st),
        st=st,
        seed=seed,
        is_causal=resolved.is_causal,
        eos_token_ids=_eos_token_ids(path, hf_config),
        model_impl=resolved.model_impl,
        trust_remote_code=trust_remote_code,
        output_head=resolved.output_head,
        head_tasks=get_head(resolved.output_head).tasks,
        sparse=resolved.sparse,
        multi_vector=multi_vector,
        quantization=quantization,
        revision=revision,
        source=location.source,
        commit=location.commit,
    )
    if resolved.check_at_load:
        from tidepool.transformers_backend.fallback import fallback_if_backend_fails

        config = fallback_if_backend_fails(config, strict=not resolved.fallback_on_forward_error)
    return config


def resolve_model(
    hf_config: Any, path: Path, runner: str, convert: str, model_impl: str, trust_remote_code: bool
) -> ResolvedModel:
    """Task, architecture and implementation of a checkpoint; the transformers backend checks
    that it can run the HF class (on the meta device: nothing allocated). With model_impl="auto"
    a pooling model the backend cannot run goes to the fallback (transformers_backend/fallback.py)."""
    checkpoint_arch = _checkpoint_architecture(hf_config)
    if runner == "auto" and checkpoint_arch.endswith("ForCausalLM") and declares_st_pooling(path):
        # vLLM's rule (and sentence-transformers'): the folder is an embedder (Qwen3-Embedding).
        runner = "pooling"
        log_st_embedder(path, checkpoint_arch)
    task, arch = _resolve_task(checkpoint_arch, runner, convert, model_impl)
    refuse_unsupported_kind(arch, hf_config, task)  # images, encoder-decoders: say what runs
    head = detect_head(Checkpoint(checkpoint_arch, task, arch, path, convert, model_impl))
    if head is not None:
        task, arch = head.task, head.architecture
    if model_impl in ("auto", "native") and task != "generate":
        arch = native_architecture(arch, hf_config)  # EmbeddingGemma: the encoder variant
    impl = resolve_model_impl(arch, model_impl)
    _refuse_images_off_native(arch, hf_config, impl)
    output_head = "task" if head is None else head.head
    sparse = None if head is None else head.sparse
    if impl == "native":
        if getattr(hf_config, "classifier_from_token", None):
            _set_classifier_from_token(hf_config, path, arch)
        is_causal = bool(getattr(get_model_class(arch), "is_causal", False))
        return ResolvedModel(task, arch, impl, is_causal, None, output_head, sparse)
    if getattr(hf_config, "classifier_from_token", None):
        raise ValueError(
            f"classifier_from_token needs tidepool's native {arch}; the transformers backend "
            "and the fallback read the checkpoint's own head"
        )
    from tidepool.transformers_backend.attention import UnsupportedAttentionError
    from tidepool.transformers_backend.backend import inspect_hf_model
    from tidepool.transformers_backend.fallback import inspect_fallback

    reason = 'model_impl="fallback" was asked for'
    if impl == "transformers":
        try:
            info = inspect_hf_model(arch, task, hf_config, path, trust_remote_code)
            # auto, an encoder: a backend whose first forward fails falls back before loading.
            fallback_ok = model_impl == "auto" and not info.is_causal
            return ResolvedModel(
                task,
                arch,
                impl,
                info.is_causal,
                info.position_offset,
                output_head,
                sparse,
                fallback_ok,
                check_at_load=not info.is_causal,
            )
        except UnsupportedAttentionError as e:
            if model_impl != "auto" or task == "generate":
                raise  # model_impl="transformers" stays strict; generation needs our KV cache
            reason = str(e)
    # auto, when the backend cannot plug in: the HF model as it is (one warning line).
    fallback = inspect_fallback(arch, task, hf_config, path, trust_remote_code, reason)
    return ResolvedModel(
        task, arch, "fallback", False, fallback.position_offset, output_head, sparse
    )


def _set_classifier_from_token(hf_config: Any, path: Path, arch: str) -> None:
    """hf_overrides' `classifier_from_token` (vLLM's): the head is built from the LM head's rows of
    these tokens (models/causal_classifier.py). Writes the token ids, the method and num_labels
    into `hf_config` (the model class reads nothing else)."""
    from tidepool.models.causal_classifier import SEQ_CLS_METHODS

    if not arch.endswith("ForSequenceClassification"):
        raise ValueError(
            f"classifier_from_token needs a sequence-classification architecture, got {arch} "
            '(add "architectures": ["<Model>ForSequenceClassification"] or convert="classify")'
        )
    tokens = list(hf_config.classifier_from_token)
    default = (
        "from_2_way_softmax" if getattr(hf_config, "is_original_qwen3_reranker", False) else None
    )
    method = getattr(hf_config, "method", None) or default or "no_post_processing"
    if method not in SEQ_CLS_METHODS:
        raise ValueError(f"method must be one of {', '.join(SEQ_CLS_METHODS)}, got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            f"from_2_way_softmax needs two tokens [false, true] in classifier_from_token, got {tokens}"
        )
    hf_config.classifier_from_token_ids = [_token_id(path, token) for token in tokens]
    hf_config.classifier_method = method
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)


def _token_id(path: Path, token: str) -> int:
    """The vocabulary id of `token` (one token, as the tokenizer spells it)."""
    from tokenizers import Tokenizer

    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"classifier_from_token needs the model's tokenizer.json in {path}")
    token_id = Tokenizer.from_file(str(tokenizer_file)).token_to_id(token)
    if token_id is None:
        raise ValueError(f"classifier_from_token: {token!r} is not one token of the vocabulary")
    return int(token_id)


def _refuse_images_off_native(arch: str, hf_config: Any, impl: str) -> None:
    """An image model (a vision_config: CLIP, SigLIP, Qwen2-VL, ColPali) runs on its native model
    only: the transformers backend and the fallback take token ids, not images."""
    if impl == "native" or getattr(hf_config, "vision_config", None) is None:
        return
    raise ValueError(
        f"{arch} takes images, which only tidepool's native {arch} runs: load it with "
        f'model_impl="auto" or "native", not {impl!r}. (A CLIPModel folder\'s text tower alone '
        'runs on the transformers backend with hf_overrides={"architectures": '
        '["CLIPTextModelWithProjection"]}.)'
    )


def _checkpoint_architecture(hf_config: Any) -> str:
    """config.json's first architecture, else the bare body of its config class."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return archs[0] if archs else f"{type(hf_config).__name__.removesuffix('Config')}Model"


def _base_architecture(arch: str) -> str:
    if arch in COLBERT_IR_ARCHITECTURES:
        return COLBERT_IR_ARCHITECTURES[arch]
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
    embeds, e.g. e5-mistral, or with convert="classify" its *ForSequenceClassification scores);
    *ForSequenceClassification classifies; anything else embeds.
    """
    if runner == "generate":
        return "generate", _causal_lm(arch, convert, model_impl)
    is_classifier = arch.endswith("ForSequenceClassification")
    if convert == "embed":
        return "embed", _base_architecture(arch)
    if convert == "classify":
        if arch.endswith("ForCausalLM"):
            # The checkpoint's score.weight, or hf_overrides' classifier_from_token rows.
            return "classify", arch.removesuffix("ForCausalLM") + "ForSequenceClassification"
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


def _causal_lm(arch: str, convert: str, model_impl: str) -> str:
    """The *ForCausalLM that generates for `arch` (itself, or the LM of a bare body)."""
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
    return causal_lm


def _position_max_model_len(
    hf_config: Any, resolved: ResolvedModel, st: SentenceTransformersMeta
) -> int:
    """The longest prompt the model's positions allow (and sentence-transformers' cap); a
    dual-tower model's (CLIP, SigLIP) are its text tower's."""
    # A vision-language config keeps the text's positions in its text config (Qwen2-VL, CLIP).
    text_config = (
        hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    )
    derived = int(getattr(text_config, "max_position_embeddings", 512))
    if resolved.position_offset is not None:
        derived -= resolved.position_offset  # the transformers backend read it from the model
    elif any(resolved.architecture.startswith(p) for p in _ROBERTA_LIKE):
        pad = getattr(hf_config, "pad_token_id", None)
        derived -= (1 if pad is None else int(pad)) + 1  # positions start after padding_idx
    if st.max_seq_length is not None:
        derived = min(derived, st.max_seq_length)
    return derived


def _resolve_max_model_len(
    max_model_len: int | None,
    hf_config: Any,
    resolved: ResolvedModel,
    st: SentenceTransformersMeta,
) -> int:
    """max_model_len, or by default the positions' limit; for a plain (not sentence-transformers)
    bidirectional encoder whose tokenizer says a shorter model_max_length, that length, where
    sentence-transformers' SentenceTransformer / CrossEncoder truncate: longer texts are then
    refused (or cut with truncate_prompt_tokens), never scored past the reference's length. An
    explicit max_model_len may go up to the positions' limit."""
    derived = _position_max_model_len(hf_config, resolved, st)
    if max_model_len is None:
        cap = st.tokenizer_max_length
        if not st.is_sentence_transformer and not resolved.is_causal and cap and cap < derived:
            logger.info(
                "max_model_len %d: the tokenizer's model_max_length (sentence-transformers "
                "truncates there), below the %d positions; max_model_len= lifts it",
                cap,
                derived,
            )
            return cap
        return derived
    if max_model_len > derived:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model allows ({derived} tokens)"
        )
    return int(max_model_len)


def _read_model_type(path: Path) -> object:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


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
