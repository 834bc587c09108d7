"""The rest of vLLM 0.32's engine arguments (EngineArgs and LLM.__init__), grouped by why they
have no counterpart here; engine/vllm_args.py merges them into VLLM_ARGS with the same rules
("warn": harmless here, accepted with a warning when set; "refuse": ValueError naming it unless
the value is unset: None, False, or vLLM's own default given below). Recorded from the installed
vLLM by tests/conformance/record_vllm_surface.py; test_vllm_surface.py checks every name."""

from __future__ import annotations

from typing import Any

_GPU = "a GPU / distributed-runtime knob with no counterpart on tidepool's engine"
_ONE = "tidepool runs one engine process on one device"
_MM = "tidepool serves text models only (no multimodal inputs)"
_MAMBA = "tidepool has no Mamba / state-space models"
_MOE = "tidepool has no mixture-of-experts models"
_LORA = "tidepool has no LoRA adapters"
_SPEC = "no speculative decoding"
_OFFLOAD = "weights stay on the model's device (no offloading)"
_METRICS = "/metrics has tidepool's engine metrics (no extra vLLM metric families)"
_LOG = "logging is configured by Python's logging module"

# (policy, reason, {name: vLLM's default, or None when it is None / False / a config object})
GROUPS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("warn", _GPU, {
        "attention_backend": None, "cp_kv_cache_interleave_size": None,
        "dbo_decode_token_threshold": 32, "dbo_prefill_token_threshold": 512,
        "dcp_comm_backend": None, "dcp_kv_cache_interleave_size": 1, "dcp_q_replicate": None,
        "disable_nccl_for_dp_synchronization": None, "dp_sync_interval": 16,
        "enable_cumem_allocator": None, "enable_dbo": None, "enable_flashinfer_autotune": None,
        "enable_hc_sp": None, "enable_nccl_comm_suspend": None, "enable_shm_tensor_arena": None,
        "gdn_prefill_backend": None, "ir_op_priority": None, "jit_monitor_mode": "warn",
        "jit_monitor_verbose": None, "kda_decode_backend": None, "kda_prefill_backend": None,
        "kernel_config": None, "linear_backend": "auto", "moe_backend": "auto",
        "sparse_indexer_topk_backend": "auto", "optimization_level": 2,
        "performance_mode": "balanced", "ubatch_size": 0, "use_fp64_gumbel": None,
        "safetensors_prefetch_block_size": 16777216, "safetensors_prefetch_num_threads": 8,
        "renderer_num_workers": 1, "fail_on_environ_validation": None,
        "enable_layerwise_nvtx_tracing": None, "enable_trace_replay": None,
        "distributed_timeout_seconds": None, "cpu_distributed_timeout_seconds": None,
        "master_addr": "127.0.0.1", "master_port": 29501, "numa_bind": None,
        "numa_bind_cpus": None, "numa_bind_nodes": None, "allow_deprecated_quantization": None,
        "scheduler_reserve_full_isl": True, "swa_bounded_replay": True,
        "prefill_schedule_interval": 1, "stream_interval": 1,
    }),
    ("warn", _METRICS, {
        "cudagraph_metrics": None, "custom_histogram_buckets": None, "kv_cache_metrics": None,
        "kv_cache_metrics_sample": 0.01, "enable_mfu_metrics": None,
        "enable_mm_processor_stats": None, "per_request_spec_decode_metrics": "none",
        "enable_logging_iteration_details": None,
    }),
    ("refuse", _LOG, {"log_config_file": None, "log_level": None, "logging_config": None}),
    ("refuse", _ONE, {
        "device_ids": None, "nnodes": 1, "node_rank": 0, "prefill_context_parallel_size": 1,
        "data_parallel_external_lb": None, "data_parallel_multi_port_external_lb": None,
        "enable_elastic_ep": None, "elastic_ep_max_dp_size": None,
        "enable_fault_tolerance": None, "fault_tolerance_config": None,
        "enable_batch_sharded_sampling": None, "weight_transfer_config": None,
    }),
    ("refuse", _MOE, {
        "enable_ep_weight_filter": None, "expert_placement_strategy": "linear",
        "aux_output_config": None, "engram_config": None,
    }),
    ("refuse", _MAMBA, {
        "enable_mamba_cache_stochastic_rounding": None,
        "enable_mamba_shared_prefix_checkpoint": None, "mamba_backend": None,
        "mamba_cache_mode": "none", "mamba_cache_philox_rounds": 0, "mamba_config": None,
        "mamba_ssu_algorithm": None, "use_replayssm": None, "replayssm_buffer_len": 16,
    }),
    ("refuse", _MM, {
        "language_model_only": None, "mm_device_do_normalize": True,
        "mm_encoder_attn_dtype": None, "mm_encoder_fp8_scale_path": None,
        "mm_encoder_fp8_scale_save_margin": 1.5, "mm_encoder_fp8_scale_save_path": None,
        "mm_encoder_only": None, "mm_hasher_algorithm": "blake3", "mm_ipc_gpu_memory_gb": 0,
        "mm_processor_device": "auto", "mm_tensor_ipc": "direct_rpc",
        "video_pruning_method": "evs", "ec_manager_config": None, "ec_transfer_config": None,
        "diffusion_config": None,
    }),
    ("refuse", _LORA, {
        "enable_mixed_moe_lora_format": None, "enable_moe_shared_loras": None,
        "enable_tower_connector_lora": None, "lora_target_modules": None,
        "max_lora_cls_labels": None, "specialize_active_lora": None,
    }),
    ("refuse", _SPEC, {"spec_method": None, "spec_model": None, "spec_tokens": None}),
    ("refuse", _OFFLOAD, {
        "cpu_offload_params": None, "offload_backend": "auto", "offload_group_size": 0,
        "offload_num_in_group": 1, "offload_params": None, "offload_prefetch_step": 1,
        "kv_offloading_backend": "native", "kv_offloading_size": None,
        "sleep_mode_offload_cudagraph": None, "sleep_preserve_parameter_names": None,
    }),
    ("refuse", "the scheduler has no such limit (admission limits are the server's: "
     "--max-concurrent-requests, --max-queued-tokens)", {
        "max_num_active_seqs": None, "max_num_queued_reqs": None,
        "max_num_queued_tokens": None, "max_num_scheduled_tokens": None,
        "long_prefill_token_threshold_adaptive": None,
    }),
    ("refuse", "the prefix cache matches whole blocks and keeps them while memory allows", {
        "prefix_cache_retention_interval": 0, "prefix_match_unit": None,
        "kv_cache_dtype_skip_layers": None,
    }),
    ("refuse", "quantization is chosen by `quantization` (int8) alone", {
        "quantization_config": None,
    }),
    ("refuse", "tidepool's generation has no reasoning parsers", {
        "reasoning_config": None, "reasoning_parser_plugin": None,
    }),
    ("refuse", "tidepool's generation has no watermarking", {
        "watermark": 0.0, "watermark_config": None,
    }),
    ("refuse", "models are built by tidepool's registry from config.json", {
        "model_class_overrides": None, "model_weights": "",
    }),
    ("refuse", "outputs carry no sampling mask", {"return_sampling_mask": None}),
    ("refuse", "the engine always takes text (it has a tokenizer)", {"tokens_only": None}),
    ("refuse", "LLM() has no graceful shutdown (`tidepool serve --shutdown-timeout` is the "
     "server's drain, as vLLM's flag)", {"shutdown_timeout": 0}),
)  # fmt: skip

SWITCHES = frozenset(
    "allow_deprecated_quantization cudagraph_metrics data_parallel_external_lb "
    "data_parallel_multi_port_external_lb dcp_q_replicate disable_nccl_for_dp_synchronization "
    "enable_batch_sharded_sampling enable_cumem_allocator enable_dbo enable_elastic_ep "
    "enable_ep_weight_filter enable_fault_tolerance enable_flashinfer_autotune enable_hc_sp "
    "enable_layerwise_nvtx_tracing enable_logging_iteration_details "
    "enable_mamba_cache_stochastic_rounding enable_mamba_shared_prefix_checkpoint "
    "enable_mfu_metrics enable_mm_processor_stats enable_mixed_moe_lora_format "
    "enable_moe_shared_loras enable_nccl_comm_suspend enable_shm_tensor_arena "
    "enable_tower_connector_lora enable_trace_replay fail_on_environ_validation "
    "jit_monitor_verbose kv_cache_metrics language_model_only "
    "long_prefill_token_threshold_adaptive mm_device_do_normalize mm_encoder_only numa_bind "
    "return_sampling_mask scheduler_reserve_full_isl sleep_mode_offload_cudagraph "
    "specialize_active_lora swa_bounded_replay tokens_only use_fp64_gumbel use_replayssm".split()
)
"""The names above that `vllm serve` takes as switches (`--x` / `--no-x`), not values."""


def more_vllm_args() -> list[tuple[str, str, str, bool, tuple[Any, ...]]]:
    """GROUPS as vllm_args._TABLE's rows: name, policy, reason, switch, unset values (vLLM's
    default and the empty containers besides None / False)."""
    rows = []
    for policy, reason, names in GROUPS:
        for name, default in names.items():
            unset = ((), "", 0) if default is None else (default,)
            rows.append((name, policy, reason, name in SWITCHES, unset))
    return rows
