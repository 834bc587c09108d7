"""SchedulerOutput → flat batch → model → output stage → one tensor per request."""

from __future__ import annotations

import itertools

import torch

from tidepool.attention.metadata import build_encoder_metadata
from tidepool.config import EngineConfig
from tidepool.core.sched_output import SchedulerOutput
from tidepool.models.registry import build_model
from tidepool.worker.pooler import Pooler, PoolingMetadata


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        torch.manual_seed(config.model.seed)
        self.model = build_model(config.model)
        self.pooler = Pooler(config.model, self.model)
        self.num_heads = int(config.model.hf_config.num_attention_heads)
        # positions are 0..len-1 per sequence: slices of one arange, made once.
        self._arange = torch.arange(config.model.max_model_len, dtype=torch.int64)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> dict[str, torch.Tensor]:
        # Longest first, so that sequences of similar length are neighbours: attention runs them
        # as a few padded buckets instead of one call per sequence (see attention/metadata.py).
        requests = sorted(sched_out.scheduled, key=lambda r: -r.num_prompt_tokens)
        seq_lens = [r.num_prompt_tokens for r in requests]
        device = self.device
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(r.prompt_token_ids for r in requests)),
            dtype=torch.int64,
        )
        positions = torch.cat([self._arange[:n] for n in seq_lens])
        token_type_ids = None
        if any(r.token_type_ids is not None for r in requests):
            token_type_ids = torch.tensor(
                list(
                    itertools.chain.from_iterable(
                        r.token_type_ids or itertools.repeat(0, r.num_prompt_tokens)
                        for r in requests
                    )
                ),
                dtype=torch.int64,
            ).to(device, non_blocking=True)
        input_ids = input_ids.to(device, non_blocking=True)
        positions = positions.to(device, non_blocking=True)
        attn_meta = build_encoder_metadata(seq_lens, device, num_heads=self.num_heads)
        hidden = self.model(input_ids, positions, attn_meta, token_type_ids)
        pool_meta = PoolingMetadata(
            seq_lens=seq_lens,
            cu_seqlens=attn_meta.cu_seqlens,
            params=[r.pooling_params for r in requests],
        )
        outputs = self.pooler(hidden, pool_meta)
        return {r.request_id: out for r, out in zip(requests, outputs)}
