"""vLLM's engine arguments that tidepool's `EngineArgs` does not have, and what each does here.

Every `LLM(...)` keyword and `vllm serve` engine flag of vLLM (0.32; the names below are those
of vLLM's `EngineArgs` and `LLM.__init__`) is one of:

- a field of `EngineArgs` (engine/args.py): implemented;
- "warn": harmless here (CUDA graphs, compilation, GPU-only knobs, a parallel size of 1):
  accepted, and a warning says it has no effect;
- "refuse": a feature tidepool does not have: ValueError naming it and why, unless the value
  is "unset" (None, False, or vLLM's default listed here), which changes nothing.

A name that is (or becomes) an `EngineArgs` field is never looked up here: fields win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidepool.engine.vllm_args_more import more_vllm_args


@dataclass(frozen=True)
class VllmArg:
    name: str
    policy: str
    """ "warn" or "refuse"."""
    reason: str
    switch: bool = False
    """A bool flag (`--x / --no-x`); else it takes a value."""
    unset: tuple[Any, ...] = (None, False)
    """Values that change nothing (accepted quietly)."""


_ONE_DEVICE = "tidepool runs one engine process on one device"
_NO_GRAPHS = "tidepool runs eagerly (no CUDA graphs, no torch.compile)"
_HUB = (
    "the model's code and tokenizer come from the model's own revision (`revision`); a "
    "separate code or tokenizer revision is not implemented"
)
_MM = "tidepool serves text models only (no multimodal inputs)"
_LORA = "tidepool has no LoRA adapters"
_GEN = "tidepool's generation has no "

# name, policy, reason, switch, extra unset values
_TABLE: tuple[tuple[str, str, str, bool, tuple[Any, ...]], ...] = (
    # no effect here: accepted with a warning
    ("enforce_eager", "warn", _NO_GRAPHS, True, ()),
    ("compilation_config", "warn", _NO_GRAPHS, False, ()),
    ("cuda_graph_sizes", "warn", _NO_GRAPHS, False, ()),
    ("cudagraph_capture_sizes", "warn", _NO_GRAPHS, False, ()),
    ("max_cudagraph_capture_size", "warn", _NO_GRAPHS, False, ()),
    ("max_seq_len_to_capture", "warn", _NO_GRAPHS, False, ()),
    ("disable_custom_all_reduce", "warn", _ONE_DEVICE, True, ()),
    ("disable_async_output_proc", "warn", "outputs are built on the engine's thread", True, ()),
    (
        "disable_log_stats",
        "warn",
        "tidepool logs no periodic engine stats (/metrics has them)",
        True,
        (),
    ),
    ("aggregate_engine_logging", "warn", "tidepool logs no periodic engine stats", True, ()),
    (
        "swap_space",
        "warn",
        "preempted requests are recomputed, never swapped to CPU",
        False,
        (4, 4.0),
    ),
    ("max_logprobs", "warn", "any number of logprobs may be asked for", False, (20,)),
    ("use_tqdm_on_load", "warn", "loading shows no progress bar", True, (True,)),
    ("max_parallel_loading_workers", "warn", "weights load in one thread", False, ()),
    ("seed_everything", "warn", "the seed is applied when the runner starts", True, ()),
    # a parallel size of 1 is what tidepool does
    ("tensor_parallel_size", "refuse", _ONE_DEVICE, False, (1,)),
    ("pipeline_parallel_size", "refuse", _ONE_DEVICE, False, (1,)),
    (
        "data_parallel_size",
        "refuse",
        _ONE_DEVICE + " (run several servers behind a balancer)",
        False,
        (1,),
    ),
    ("decode_context_parallel_size", "refuse", _ONE_DEVICE, False, (1,)),
    ("data_parallel_rank", "refuse", _ONE_DEVICE, False, ()),
    ("data_parallel_start_rank", "refuse", _ONE_DEVICE, False, ()),
    ("data_parallel_size_local", "refuse", _ONE_DEVICE, False, ()),
    ("data_parallel_address", "refuse", _ONE_DEVICE, False, ()),
    ("data_parallel_rpc_port", "refuse", _ONE_DEVICE, False, ()),
    ("data_parallel_backend", "refuse", _ONE_DEVICE, False, ("mp",)),
    ("data_parallel_hybrid_lb", "refuse", _ONE_DEVICE, True, ()),
    ("distributed_executor_backend", "refuse", _ONE_DEVICE, False, ()),
    ("enable_expert_parallel", "refuse", _ONE_DEVICE, True, ()),
    ("enable_eplb", "refuse", "tidepool has no mixture-of-experts models", True, ()),
    ("eplb_config", "refuse", "tidepool has no mixture-of-experts models", False, ()),
    ("num_redundant_experts", "refuse", "tidepool has no mixture-of-experts models", False, ()),
    ("all2all_backend", "refuse", _ONE_DEVICE, False, ()),
    ("worker_cls", "refuse", _ONE_DEVICE, False, ("auto",)),
    ("worker_extension_cls", "refuse", _ONE_DEVICE, False, ("",)),
    ("ray_workers_use_nsight", "refuse", _ONE_DEVICE, True, ()),
    ("cpu_offload_gb", "refuse", "weights stay on the model's device", False, (0, 0.0)),
    # the Hub: revision / download_dir / hf_token are EngineArgs fields (checkpoint/hub.py)
    ("code_revision", "refuse", _HUB, False, ()),
    ("tokenizer_revision", "refuse", _HUB, False, ()),
    ("hf_config_path", "refuse", "config.json is read from the model folder", False, ()),
    (
        "config_format",
        "refuse",
        "config.json is read as Hugging Face writes it",
        False,
        ("auto", "hf"),
    ),
    (
        "load_format",
        "refuse",
        "weights load from safetensors (or PyTorch) files",
        False,
        ("auto", "safetensors"),
    ),
    ("safetensors_load_strategy", "refuse", "safetensors load one way", False, ("lazy",)),
    ("model_loader_extra_config", "refuse", "one weight loader", False, ()),
    ("ignore_patterns", "refuse", "one weight loader", False, ()),
    ("pt_load_map_location", "refuse", "weights load onto the model's device", False, ("cpu",)),
    # tokenizer
    (
        "skip_tokenizer_init",
        "refuse",
        "tidepool always loads the tokenizer (prompts, special tokens, pairs)",
        True,
        (),
    ),
    ("enable_prompt_embeds", "refuse", "prompts are text or token ids, not embeddings", True, ()),
    # cache / scheduling
    ("kv_cache_dtype", "refuse", "the KV cache is kept in the model's dtype", False, ("auto",)),
    ("calculate_kv_scales", "refuse", "the KV cache is kept in the model's dtype", True, ()),
    (
        "num_gpu_blocks_override",
        "refuse",
        "the KV cache is sized by kv_cache_memory_bytes / _fraction",
        False,
        (),
    ),
    ("prefix_caching_hash_algo", "refuse", "one prefix-cache hash", False, ("sha256", "builtin")),
    ("kv_sharing_fast_prefill", "refuse", "no cross-layer KV sharing", True, ()),
    ("mamba_cache_dtype", "refuse", "tidepool has no Mamba models", False, ("auto",)),
    ("mamba_ssm_cache_dtype", "refuse", "tidepool has no Mamba models", False, ("auto",)),
    ("mamba_block_size", "refuse", "tidepool has no Mamba models", False, ()),
    (
        "disable_sliding_window",
        "refuse",
        "sliding windows are honoured (disable_hybrid_kv_cache_manager keeps every block)",
        True,
        (),
    ),
    ("disable_cascade_attn", "warn", "tidepool has no cascade attention", True, ()),
    (
        "max_num_partial_prefills",
        "refuse",
        "chunked prefill has no partial-prefill limits",
        False,
        (1,),
    ),
    (
        "max_long_partial_prefills",
        "refuse",
        "chunked prefill has no partial-prefill limits",
        False,
        (1,),
    ),
    ("num_lookahead_slots", "refuse", "no speculative decoding", False, (0,)),
    (
        "scheduling_policy",
        "refuse",
        "requests are scheduled first come, first served",
        False,
        ("fcfs",),
    ),
    ("scheduler_cls", "refuse", "one scheduler per model kind", False, ()),
    ("async_scheduling", "refuse", "steps are not overlapped with output processing", True, ()),
    ("disable_chunked_mm_input", "refuse", _MM, True, ()),
    # model behaviour
    (
        "rope_scaling",
        "refuse",
        "the model's config.json rope settings are used (hf_overrides can change them)",
        False,
        (),
    ),
    (
        "rope_theta",
        "refuse",
        "the model's config.json rope settings are used (hf_overrides can change them)",
        False,
        (),
    ),
    ("logprobs_mode", "refuse", _GEN + "processed logprobs modes", False, ("raw_logprobs",)),
    (
        "generation_config",
        "refuse",
        "generation_config.json is read for EOS ids only",
        False,
        ("auto",),
    ),
    ("override_generation_config", "refuse", _GEN + "generation_config defaults", False, ()),
    ("logits_processor_pattern", "refuse", _GEN + "logits processors", False, ()),
    ("logits_processors", "refuse", _GEN + "logits processors", False, ()),
    ("structured_outputs_config", "refuse", _GEN + "structured outputs", False, ()),
    ("guided_decoding_backend", "refuse", _GEN + "structured outputs", False, ()),
    ("reasoning_parser", "refuse", _GEN + "reasoning parsers", False, ("",)),
    ("speculative_config", "refuse", "no speculative decoding", False, ()),
    ("override_attention_dtype", "refuse", "attention runs in the model's dtype", False, ()),
    ("override_pooler_config", "refuse", "removed in vLLM: use pooler_config", False, ()),
    ("io_processor_plugin", "refuse", "no IO-processor plugins", False, ()),
    ("enable_sleep_mode", "refuse", "no sleep mode", True, ()),
    ("kv_transfer_config", "refuse", "no KV transfer (disaggregated prefill)", False, ()),
    ("kv_events_config", "refuse", "no KV-cache events", False, ()),
    ("additional_config", "refuse", "no platform plugins", False, ()),
    ("otlp_traces_endpoint", "refuse", "no OpenTelemetry tracing", False, ()),
    ("collect_detailed_traces", "refuse", "no OpenTelemetry tracing", False, ()),
    ("show_hidden_metrics_for_version", "refuse", "no hidden metrics", False, ()),
    (
        "served_model_name",
        "refuse",
        "LLM() serves nothing (tidepool serve --served-model-name names models)",
        False,
        (),
    ),
    ("limit_mm_per_prompt", "refuse", _MM, False, ()),
    ("enable_mm_embeds", "refuse", _MM, True, ()),
    ("interleave_mm_strings", "refuse", _MM, True, ()),
    (
        "media_io_kwargs",
        "refuse",
        "image decoding takes no options here (always RGB, alpha over white)",
        False,
        (),
    ),
    ("mm_processor_kwargs", "refuse", _MM, False, ()),
    ("mm_processor_cache_gb", "refuse", _MM, False, (4, 4.0)),
    ("mm_processor_cache_type", "refuse", _MM, False, ()),
    ("mm_shm_cache_max_object_size_mb", "refuse", _MM, False, ()),
    ("mm_encoder_tp_mode", "refuse", _MM, False, ()),
    ("mm_encoder_attn_backend", "refuse", _MM, False, ()),
    ("skip_mm_profiling", "refuse", _MM, True, ()),
    ("video_pruning_rate", "refuse", _MM, False, ()),
    ("enable_lora", "refuse", _LORA, True, ()),
    ("max_loras", "refuse", _LORA, False, (1,)),
    ("max_lora_rank", "refuse", _LORA, False, (16,)),
    ("max_cpu_loras", "refuse", _LORA, False, ()),
    ("lora_dtype", "refuse", _LORA, False, ("auto",)),
    ("fully_sharded_loras", "refuse", _LORA, True, ()),
    ("default_mm_loras", "refuse", _LORA, False, ()),
    ("attention_config", "refuse", "attention backends are chosen per model and device", False, ()),
    ("profiler_config", "refuse", "no built-in profiler", False, ()),
    (
        "enable_return_routed_experts",
        "refuse",
        "tidepool has no mixture-of-experts models",
        True,
        (),
    ),
)

VLLM_ARGS: dict[str, VllmArg] = {
    name: VllmArg(name, policy, reason, switch, (None, False, *unset))
    for name, policy, reason, switch, unset in (*_TABLE, *more_vllm_args())
}
"""vLLM engine argument name → what it does here (names not in tidepool's EngineArgs)."""

FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
    "decode_context_parallel_size": ("-dcp",),
    "compilation_config": ("-O",),
    "quantization": ("-q",),
}
"""vLLM's short flags."""


def is_unset(arg: VllmArg, value: Any) -> bool:
    """`value` changes nothing: one of arg.unset (an empty list / dict / set counts as the
    empty tuple when that is one)."""
    if isinstance(value, (list, dict, set, frozenset)) and not value and () in arg.unset:
        return True
    return any(value is u or (type(value) is type(u) and value == u) for u in arg.unset) or (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and any(
            not isinstance(u, bool) and isinstance(u, (int, float)) and value == u
            for u in arg.unset
        )
    )


def check_vllm_args(given: dict[str, Any], fields: frozenset[str]) -> list[str]:
    """The vLLM-only arguments among `given` (names that are not `fields`): ValueError for a
    refused one that is set; the warnings to log for the harmless ones that are set."""
    warnings = []
    for name, value in given.items():
        arg = VLLM_ARGS.get(name)
        if name in fields or arg is None or is_unset(arg, value):
            continue
        if arg.policy == "refuse":
            raise ValueError(f"{name}={value!r} is not supported here: {arg.reason}")
        warnings.append(f"{name}={value!r} has no effect here: {arg.reason}")
    return warnings
