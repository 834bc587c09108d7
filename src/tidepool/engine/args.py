"""The engine's arguments (`LLM(model, **engine_args)`, `AsyncEngine.from_args`, the server's
flags) and the frozen EngineConfig they build."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from tidepool import envs
from tidepool.config import CacheConfig, EngineConfig, PoolerConfig, SchedulerConfig
from tidepool.engine.score_template import resolve_score_template
from tidepool.models.loader import DEFAULT_MODEL
from tidepool.models.resolve import build_model_config

logger = logging.getLogger("tidepool")

ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096

# Default step budget of causal models (chunked prefill lets prompts exceed it).
CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """The engine arguments of `LLM(model, **engine_args)` and `AsyncEngine.from_args`: the one
    place that owns their names and defaults."""

    runner: str = "auto"
    """ "pooling", "generate" or "auto" (from the model's architecture)."""
    convert: str = "auto"
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
    """Pooler options (vLLM's): {"enable_chunked_processing": true, "max_embed_len": N,
    "chunk_score_aggregation": "max"}; None: the defaults (long inputs refused)."""

    def to_engine_config(self, model: str) -> EngineConfig:
        """The frozen engine configuration (reads the model's config files; loads no weights and
        changes no process state: thread counts are applied when the engine starts)."""
        model_config = build_model_config(
            model,
            convert=self.convert,
            runner=self.runner,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            device=self.device,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            model_impl=self.model_impl,
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
        if self.pooler_config is not None:
            pooler = self.pooler_config
            if isinstance(pooler, dict):
                pooler = PoolerConfig(**pooler)
            model_config = replace(model_config, pooler=pooler)
        # Encoders run each prompt whole; causal models with chunked prefill do not need to.
        whole_prompts = not model_config.is_causal or not self.enable_chunked_prefill
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            if model_config.is_causal:
                max_num_batched_tokens = CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS
            else:
                # Measured (MiniLM, 800 texts, CPU seconds): 4,096-token steps beat 8,192 by 1.1x
                # and 16,384 by 1.3x in float32 (activations stay closer to cache), tie in bfloat16.
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
        )


ENGINE_ARG_NAMES = frozenset(f.name for f in fields(EngineArgs))


def build_engine_config(model: str = DEFAULT_MODEL, **engine_args: Any) -> EngineConfig:
    """The engine configuration from `LLM`'s arguments (`EngineArgs`); shared with the server's
    AsyncEngine."""
    return EngineArgs(**engine_args).to_engine_config(model)


# vLLM arguments that mean nothing here; accepted (and ignored) so code ports unchanged.
_IGNORED_VLLM_ARGS = {
    "enforce_eager",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "disable_log_stats",
    "swap_space",
    "task",
}


def _wants_gpu(device: str | None) -> bool:
    return (device or "").startswith("cuda") or (
        device is None and envs.device() is None and torch.cuda.is_available()
    )


def engine_args_from_vllm(kwargs: dict[str, Any]) -> EngineArgs:
    """`LLM(**kwargs)`'s engine arguments: EngineArgs' fields, and vLLM arguments that mean nothing
    here (ignored and logged, so vLLM code ports unchanged) except `gpu_memory_utilization`,
    which sizes the KV cache on a GPU when nothing else does. TypeError for any other name."""
    unknown = set(kwargs) - ENGINE_ARG_NAMES - _IGNORED_VLLM_ARGS
    if unknown:
        raise TypeError(f"LLM() got unexpected arguments: {sorted(unknown)}")
    kwargs = dict(kwargs)
    ignored = {name: kwargs.pop(name) for name in _IGNORED_VLLM_ARGS & kwargs.keys()}
    engine_args = EngineArgs(**kwargs)
    if (
        engine_args.kv_cache_memory_fraction is None
        and engine_args.kv_cache_memory_bytes is None
        and "gpu_memory_utilization" in ignored
        # vLLM's knob sizes the KV cache on a GPU; on a CPU it means nothing (as in vLLM).
        and _wants_gpu(engine_args.device)
    ):
        memory_fraction = float(ignored.pop("gpu_memory_utilization"))
        engine_args = replace(engine_args, kv_cache_memory_fraction=memory_fraction)
    if ignored:
        logger.info("ignoring vLLM arguments that do not apply here: %s", sorted(ignored))
    return engine_args
