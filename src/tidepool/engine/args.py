"""The engine's arguments (`LLM(model, **engine_args)`, `AsyncEngine.from_args`, the CLI's
flags, generated from the fields: `EngineArgs.add_cli_args`) and the frozen EngineConfig they
build. vLLM's engine arguments tidepool does not have are in engine/vllm_args.py."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from tidepool import envs
from tidepool.checkpoint.loader import DEFAULT_MODEL
from tidepool.config import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    CacheConfig,
    EngineConfig,
    MediaConfig,
    ModelConfig,
    PoolerConfig,
    SchedulerConfig,
)
from tidepool.engine.score_template import resolve_score_template
from tidepool.engine.vllm_args import VLLM_ARGS, check_vllm_args
from tidepool.model_loader.resolve import build_model_config

logger = logging.getLogger("tidepool")

ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096

# Default step budget of causal models (chunked prefill lets prompts exceed it).
CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """The engine arguments of `LLM(model, **engine_args)`, `AsyncEngine.from_args` and the
    CLI's flags (`add_cli_args`): the one place that owns their names, types, defaults and help.
    Each field's docstring's first sentence is its flag's help."""

    model: str | None = None
    """The model: a folder or a model id (`LLM(model)` / `tidepool serve MODEL` give it too);
    None: the bundled all-MiniLM-L6-v2."""
    runner: Literal["auto", "pooling", "generate"] = "auto"
    """ "pooling", "generate" or "auto" (from the model's architecture)."""
    convert: Literal["auto", "embed", "classify"] = "auto"
    """ "embed" or "classify" turns a pooling model into that task; "auto" keeps its own."""
    dtype: str | torch.dtype = "auto"
    """Weights and activations; "auto": float32 on CPU, the model's 16-bit dtype on a GPU."""
    max_model_len: int | None = None
    """Longest prompt in tokens; None: the model's own limit."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step; None: a default by model kind (see `to_engine_config`)."""
    max_num_seqs: int = 256
    """Most sequences in one engine step."""
    seed: int = 0
    """`torch.manual_seed` when the model runner starts (sampling with no per-request seed)."""
    device: str | None = None
    """ "cpu", "cuda", "cuda:1"...; None: TIDEPOOL_DEVICE, else a GPU where there is one."""
    trust_remote_code: bool = False
    """Run the model's own code (its *.py, fetched with the snapshot) on the transformers backend
    or the fallback; without it such a model is refused."""
    revision: str | None = None
    """The Hub revision of a model id: a branch, tag or commit (default: the default branch)."""
    download_dir: str | None = None
    """The Hugging Face cache to look in and download to (default: HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    hf_token: str | bool | None = field(default=None, repr=False)
    """The Hub token for private or gated models; True: the one saved by `hf auth login`
    (default: HF_TOKEN, else that one)."""
    block_size: int = 16
    """Tokens per KV block (and per prefix-cache hash)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token prefix was computed before."""
    enable_chunked_prefill: bool = True
    """Causal models: a long prompt may run over several steps."""
    long_prefill_token_threshold: int = 0
    """Causal models with chunked prefill: most prompt tokens of one request per step (0: no cap)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache (see `LLM.__init__` for the default)."""
    kv_cache_memory_fraction: float | None = None
    """Share of the device's memory the process may use; the KV cache gets what the model left."""
    disable_hybrid_kv_cache_manager: bool = False
    """Sliding-window layers keep every block like full attention."""
    model_impl: str = "auto"
    """ "native", "transformers", "fallback" or "auto" (native where tidepool has the
    architecture, else the transformers backend, else the fallback for pooling tasks)."""
    hf_overrides: dict[str, Any] | None = None
    """Keys that replace config.json's (vLLM's name), e.g. an LLM reranker's {"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True}."""
    score_template: str | None = None
    """Decoder rerankers: the prompt of each (query, document) pair, with `{query}` and
    `{document}` (and `{instruction}`), a built-in name ("qwen3_reranker"), a file, or "none";
    None / "none": no template, the pair read as vLLM reads it (an LM reranker: the two texts
    concatenated as given; engine/score_template.py)."""
    score_instruction: str | None = None
    """The score template's `{instruction}` (needs `score_template`); None: the built-in's
    default."""
    quantization: str | None = None
    """ "int8" (vLLM's argument name): int8 weights (per output channel) and activations (per
    token) in the linear layers of native encoders on CPU; None: none."""
    pooler_config: PoolerConfig | dict[str, Any] | None = None
    """Pooler options (vLLM's PoolerConfig): {"seq_pooling_type": "CLS"}, {"task":
    "token_embed"}, {"enable_chunked_processing": true, "max_embed_len": N}; None: the model's own
    (long inputs refused)."""
    tokenizer: str | None = None
    """A folder (or cached model id) to load the tokenizer from instead of the model's."""
    tokenizer_mode: str = "auto"
    """ "auto" or "hf": the Hugging Face fast tokenizer (tokenizer.json); vLLM's "slow",
    "mistral" and "custom" are refused."""
    chat_template: str | None = None
    """The chat template (Jinja text or a file) for `chat()` and `messages` inputs; None: the
    tokenizer's own."""
    allowed_local_media_path: str = ""
    """A folder whose image files requests may name (a path or a file:// URL, resolved: symlinks
    out of it are refused); "": no local files (vLLM's flag)."""
    allowed_media_domains: list[str] | None = None
    """Host names http(s) images may come from, each redirect hop too (vLLM's flag); None: see
    allow_remote_media."""
    allow_remote_media: bool = False
    """Fetch http(s) images from any public host (not private, loopback or link-local
    addresses); off with no allowed_media_domains: http(s) images are refused."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """The largest encoded image read, in bytes (a file, a download, a data: URL)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """The most pixels (width x height) an image may have, read from its header before any pixel
    is decoded."""

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, *, include_model: bool = True
    ) -> argparse.ArgumentParser:
        """Add a flag per field (vLLM's names: `--max-model-len`, `--enable-prefix-caching /
        --no-enable-prefix-caching`, ...) and vLLM's engine flags tidepool does not implement
        (refused or warned about when given: engine/vllm_args.py); returns `parser`, as vLLM's."""
        from tidepool.engine.cli_flags import add_engine_flags

        return add_engine_flags(parser, EngineArgs, include_model=include_model)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags (vLLM's); vLLM-only flags given are checked (ValueError
        for a refused one, a warning for a harmless one)."""
        from tidepool.engine.cli_flags import engine_kwargs_of

        return engine_args_from_vllm(engine_kwargs_of(args, cls))

    def to_engine_config(self, model: str | None = None) -> EngineConfig:
        """The frozen engine configuration (reads the model's config files; loads no weights and
        changes no process state: thread counts are applied when the engine starts). `model`:
        the model, else this one's `model`, else the bundled default."""
        model = model or self.model or DEFAULT_MODEL
        check_tokenizer_mode(self.tokenizer_mode)
        model_config = build_model_config(
            model,
            convert=self.convert,
            runner=self.runner,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            device=self.device,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            model_impl="native" if self.model_impl == "vllm" else self.model_impl,
            hf_overrides=self.hf_overrides,
            quantization=self.quantization,
            revision=self.revision,
            download_dir=self.download_dir,
            hf_token=self.hf_token,
        )
        template = resolve_score_template(
            self.score_template, self.score_instruction, model_config.hf_config
        )
        if template is not None:
            if model_config.task != "classify":
                raise ValueError("score_template applies to cross-encoders (task classify) only")
            model_config = replace(model_config, score_template=template)
        model_config = apply_model_options(
            model_config, self.pooler_config, self.tokenizer, self.chat_template
        )
        # Encoders run each prompt whole; causal models with chunked prefill do not need to.
        whole_prompts = not model_config.is_causal or not self.enable_chunked_prefill
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            if model_config.is_causal:
                max_num_batched_tokens = CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS
            else:
                # 4,096-token steps beat larger ones in float32 (activations stay closer to
                # cache) and tie in bfloat16 (docs/performance.md, 'Choices in the encoder path').
                max_num_batched_tokens = ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS
            if whole_prompts:
                max_num_batched_tokens = max(max_num_batched_tokens, model_config.max_model_len)
        elif whole_prompts and max_num_batched_tokens < model_config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_model_len="
                f"{model_config.max_model_len}: "
                + (
                    "an encoder runs each prompt in one step"
                    if not model_config.is_causal
                    else "without chunked prefill a prompt runs in one step"
                )
            )
        return EngineConfig(
            model=model_config,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                memory_fraction=self.kv_cache_memory_fraction,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            ),
            num_threads=envs.num_threads(),
            media=self.media_config(),
        )

    def media_config(self) -> MediaConfig:
        """Where images may come from and their limits (ValueError for a folder that is not
        one, a limit below 1)."""
        return media_config(
            self.allowed_local_media_path,
            self.allowed_media_domains,
            self.allow_remote_media,
            self.max_image_bytes,
            self.max_image_pixels,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncEngineArgs(EngineArgs):
    """The server's engine arguments (vLLM's AsyncEngineArgs): EngineArgs and request logging."""

    enable_log_requests: bool = False
    """Log each request (its route and body, cut to --max-log-len characters)."""

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, *, include_model: bool = True
    ) -> argparse.ArgumentParser:
        from tidepool.engine.cli_flags import add_engine_flags

        return add_engine_flags(parser, AsyncEngineArgs, include_model=include_model)


ENGINE_ARG_NAMES = frozenset(f.name for f in fields(EngineArgs))
ASYNC_ENGINE_ARG_NAMES = frozenset(f.name for f in fields(AsyncEngineArgs))


def build_engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """The engine configuration from `LLM`'s arguments (`EngineArgs`); shared with the server's
    AsyncEngine."""
    names = ASYNC_ENGINE_ARG_NAMES if "enable_log_requests" in engine_args else ENGINE_ARG_NAMES
    cls = AsyncEngineArgs if names is ASYNC_ENGINE_ARG_NAMES else EngineArgs
    return cls(**engine_args).to_engine_config(model)


def media_config(
    allowed_local_media_path: str,
    allowed_media_domains: list[str] | None,
    allow_remote_media: bool,
    max_image_bytes: int,
    max_image_pixels: int,
) -> MediaConfig:
    folder = None
    if allowed_local_media_path:
        folder = Path(allowed_local_media_path).expanduser().resolve()
        if not folder.is_dir():
            raise ValueError(
                f"allowed_local_media_path {allowed_local_media_path!r} is not a folder"
            )
    for name, value in (
        ("max_image_bytes", max_image_bytes),
        ("max_image_pixels", max_image_pixels),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    domains = None
    if allowed_media_domains is not None:
        if isinstance(allowed_media_domains, str):
            allowed_media_domains = [allowed_media_domains]
        domains = tuple(d.strip().lower() for d in allowed_media_domains if d.strip())
    return MediaConfig(
        allowed_local_media_path=folder,
        allowed_media_domains=domains,
        allow_remote_media=bool(allow_remote_media),
        fetch_timeout_s=envs.image_fetch_timeout_s(),
        max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels,
    )


_TOKENIZER_MODES = {
    "slow": "tidepool needs a fast tokenizer (tokenizer.json); slow tokenizers are not supported",
    "mistral": "mistral-common tokenizers are not supported here",
    "custom": "custom tokenizer plugins are not supported here",
}


def check_tokenizer_mode(mode: str) -> None:
    if mode in ("auto", "hf"):
        return
    reason = _TOKENIZER_MODES.get(mode, "expected auto or hf")
    raise ValueError(f"tokenizer_mode={mode!r} is not supported: {reason}")


def apply_model_options(
    model_config: ModelConfig,
    pooler_config: PoolerConfig | dict[str, Any] | None,
    tokenizer: str | None,
    chat_template: str | None,
) -> ModelConfig:
    """The model configuration with the user's pooler options (PoolerConfig: the task a call
    that names none runs, the sequence pooling), tokenizer and chat template."""
    if pooler_config is not None:
        pooler = PoolerConfig(**pooler_config) if isinstance(pooler_config, dict) else pooler_config
        model_config = replace(model_config, pooler=replace(pooler, task=None))
        if pooler.task is not None:
            if pooler.task not in model_config.pooling_tasks:
                served = ", ".join(model_config.pooling_tasks) or "none"
                raise ValueError(
                    f"pooler_config task {pooler.task!r} is not one this model serves ({served})"
                )
            model_config = replace(model_config, pooler=pooler)
        if pooler.seq_pooling_type is not None:
            st = replace(model_config.st, pooling_mode=pooler.seq_pooling_type)
            model_config = replace(model_config, st=st)
    if tokenizer is not None:
        model_config = replace(model_config, tokenizer=tokenizer)
    if chat_template is not None:
        model_config = replace(model_config, chat_template=read_chat_template(chat_template))
    return model_config


def read_chat_template(value: str) -> str:
    """A chat template given as a file (vLLM's --chat-template takes either) or as Jinja text."""
    if "{" not in value and len(value) < 4096:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template {value!r}: no such file (and it is not a template)")
        return path.read_text(encoding="utf-8")
    return value


def _wants_gpu(device: str | None) -> bool:
    return (device or "").startswith("cuda") or (
        device is None and envs.device() is None and torch.cuda.is_available()
    )


# vLLM's deprecated `task` → its runner / convert (vLLM's own mapping).
_TASK_AS = {
    "embed": {"convert": "embed"},
    "embedding": {"convert": "embed"},
    "classify": {"convert": "classify"},
    "score": {"convert": "classify"},
    "generate": {"runner": "generate"},
}


def engine_args_from_vllm(
    kwargs: dict[str, Any], cls: type[EngineArgs] | None = None
) -> EngineArgs:
    """`LLM(**kwargs)`'s engine arguments: EngineArgs' fields (None for a field whose default is
    not None means its default, as in vLLM); vLLM's deprecated `task` as runner / convert;
    `gpu_memory_utilization`, which sizes the KV cache on a GPU when nothing else does (no
    effect on a CPU: a warning); every other vLLM argument as engine/vllm_args.py says (ValueError
    for one that is refused, a warning for one that has no effect). TypeError for a name vLLM
    does not have either."""
    cls = cls or (AsyncEngineArgs if "enable_log_requests" in kwargs else EngineArgs)
    names = frozenset(f.name for f in fields(cls))
    defaults = {f.name: f.default for f in fields(cls)}
    unknown = set(kwargs) - names - VLLM_ARGS.keys() - {"task", "gpu_memory_utilization"}
    if unknown:
        raise TypeError(f"LLM() got unexpected arguments: {sorted(unknown)}")
    kwargs = dict(kwargs)
    notes = check_vllm_args({k: v for k, v in kwargs.items() if k not in names}, names)
    for name in [k for k in kwargs if k not in names and k in VLLM_ARGS]:
        del kwargs[name]
    task = kwargs.pop("task", None)
    if task not in (None, "auto"):
        if task not in _TASK_AS:
            raise ValueError(f"task={task!r} is not supported here: expected {sorted(_TASK_AS)}")
        for key, value in _TASK_AS[task].items():
            kwargs.setdefault(key, value)
    memory_fraction = kwargs.pop("gpu_memory_utilization", None)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or defaults[k] is None}
    engine_args = cls(**kwargs)
    if memory_fraction is not None:
        if _wants_gpu(engine_args.device):
            if (
                engine_args.kv_cache_memory_fraction is None
                and engine_args.kv_cache_memory_bytes is None
            ):
                engine_args = replace(engine_args, kv_cache_memory_fraction=float(memory_fraction))
        else:
            notes.append(
                f"gpu_memory_utilization={memory_fraction!r} has no effect on a CPU (the KV cache "
                "is sized by kv_cache_memory_bytes / kv_cache_memory_fraction)"
            )
    for note in notes:
        logger.warning(note)
    return engine_args
