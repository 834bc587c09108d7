"""A causal step's flat batch: token ids, positions and the attention metadata, built once.

The runner describes the step's attention once, neutrally (attention/common.py: lengths, query
start locations, block tables, slot mapping); the decoder backend's builder turns that into its
own metadata. Requests are laid out decodes first (longest context first), then prefill chunks
(longest chunk first), so that neighbours have similar shapes (a bucketing backend pads them
little: attention/paged_metadata.py). Everything per token is computed with tensor ops; Python
loops run over requests only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tidepool.attention.abstract import DecoderStepMetadata
from tidepool.attention.common import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    KVGroupStep,
    slot_mapping_of,
)
from tidepool.attention.paged_metadata import AttentionView
from tidepool.core.sched_output import SchedulerOutput
from tidepool.request import Request


@dataclass
class CachedRequestState:
    """What the runner keeps about a causal request between its steps."""

    block_ids: tuple[list[int], ...]
    """The request's block table per KV-cache group."""
    generator: torch.Generator | None = None
    """Seeded requests: their own random stream (survives preemption)."""
    pooling_running: Any = None
    """Pooling requests: the running value of the chunks computed so far."""


@dataclass
class RequestStates:
    """request_id → CachedRequestState, kept in step with SchedulerOutput's block changes."""

    states: dict[str, CachedRequestState] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where seeded requests' generators live (the sampler's device)."""

    def update(self, sched_out: SchedulerOutput) -> None:
        for request_id in sched_out.finished_req_ids:
            self.states.pop(request_id, None)
        for request in sched_out.scheduled:
            request_id = request.request_id
            new_block_ids = sched_out.new_block_ids[request_id]
            state = self.states.get(request_id)
            if request_id in sched_out.restarted_req_ids:
                table = tuple(list(ids) for ids in new_block_ids)
                if state is None:
                    self.states[request_id] = CachedRequestState(
                        table, _generator(request, self.device)
                    )
                else:  # resumed after preemption: new blocks, progress from scratch
                    state.block_ids, state.pooling_running = table, None
            else:
                assert state is not None, f"request {request_id} has no runner state"
                for group_ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    group_ids.extend(new_ids)

    def __getitem__(self, request_id: str) -> CachedRequestState:
        return self.states[request_id]


def _generator(request: Request, device: torch.device) -> torch.Generator | None:
    params = request.sampling_params
    if params is None or params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


@dataclass(frozen=True)
class CausalBatch:
    requests: list[Request]
    """In flat order (see the module docstring)."""
    query_lens: list[int]
    context_lens: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_query_lens: torch.Tensor
    """[num_requests + 1] int64 on the device: request i is flat tokens cu[i]:cu[i+1]."""
    attn_metadata: DecoderStepMetadata
    """The decoder backend's metadata (its builder's, from the step's neutral description)."""
    reaches_end: list[bool]
    """The scheduled tokens reach the request's last token: sample (or finish pooling) now."""


def _flat_order(sched_out: SchedulerOutput) -> list[Request]:
    def key(request: Request) -> tuple[int, int, int]:
        num_new = sched_out.num_scheduled_tokens[request.request_id]
        seq_len = request.num_computed_tokens + num_new
        return (0, -seq_len, 0) if num_new == 1 else (1, -num_new, -seq_len)

    return sorted(sched_out.scheduled, key=key)


def build_causal_batch(
    sched_out: SchedulerOutput,
    states: RequestStates,
    views: Sequence[AttentionView],
    layer_views: tuple[int, ...],
    builder: AttentionMetadataBuilder[DecoderStepMetadata],
    dtype: torch.dtype,
    device: torch.device,
    output_rows_only: bool = False,
) -> CausalBatch:
    """The step's flat batch, its neutral attention description (attention/common.py) and the
    decoder backend's metadata made from it by `builder`. `output_rows_only`: the step reads
    only finishing requests' last tokens (sampling, LAST pooling), so the description marks
    them (CommonAttentionMetadata.output_seqs)."""
    requests = _flat_order(sched_out)
    query_lens = [sched_out.num_scheduled_tokens[r.request_id] for r in requests]
    context_lens = [r.num_computed_tokens for r in requests]
    input_ids = list(
        itertools.chain.from_iterable(
            r.token_ids_between(c, c + q)
            for r, c, q in zip(requests, context_lens, query_lens, strict=True)
        )
    )
    num_tokens = len(input_ids)
    cu, positions, token_request = _token_layout(query_lens, context_lens, num_tokens)
    reaches_end = [
        c + q >= r.num_tokens for r, c, q in zip(requests, context_lens, query_lens, strict=True)
    ]
    tables = _block_tables(requests, states, views)
    kv_groups = tuple(
        KVGroupStep(
            spec,
            tables[group_id],
            slot_mapping_of(tables[group_id], token_request, positions, spec.block_size, device),
        )
        for group_id, spec in views
    )
    common = CommonAttentionMetadata(
        query_lens=query_lens,
        seq_lens=[c + q for c, q in zip(context_lens, query_lens, strict=True)],
        query_start_loc=cu,
        causal=True,
        device=device,
        dtype=dtype,
        positions=positions,
        token_seq=token_request,
        kv_groups=kv_groups,
        layer_groups=layer_views,
        output_seqs=reaches_end if output_rows_only else None,
    )
    return CausalBatch(
        requests=requests,
        query_lens=query_lens,
        context_lens=context_lens,
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=positions.to(device, non_blocking=True),
        cu_query_lens=cu.to(device, non_blocking=True),
        attn_metadata=builder.build(common),
        reaches_end=reaches_end,
    )


def _block_tables(
    requests: list[Request], states: RequestStates, views: Sequence[AttentionView]
) -> dict[int, torch.Tensor]:
    """group id → its [requests, max_blocks] int64 block table (one per group: its views share it)."""
    out: dict[int, torch.Tensor] = {}
    for group_id, _ in views:
        if group_id not in out:
            out[group_id] = torch.from_numpy(
                _pad_table([states[r.request_id].block_ids[group_id] for r in requests])
            )
    return out


def _token_layout(
    query_lens: list[int], context_lens: list[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_query_lens [requests + 1], position [tokens], request index [tokens]), int64 CPU
    tensors. numpy's repeat, not torch.repeat_interleave: the latter cost about 1% of a decode
    step (docs/performance.md, 'Choices elsewhere in the code')."""
    q = np.asarray(query_lens, dtype=np.int64)
    cu: np.ndarray = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    context = np.asarray(context_lens, dtype=np.int64)
    token_request: np.ndarray
    if num_tokens == len(query_lens):  # decodes only: one token per request
        token_request = np.arange(num_tokens, dtype=np.int64)
        positions = context
    else:
        token_request = np.repeat(np.arange(len(query_lens), dtype=np.int64), q)
        # position of flat token t of request i = t - cu[i] + context_lens[i]
        positions = np.arange(num_tokens, dtype=np.int64) + (context - cu[:-1])[token_request]
    return torch.from_numpy(cu), torch.from_numpy(positions), torch.from_numpy(token_request)


def _pad_table(tables: list[list[int]]) -> np.ndarray:
    """Block tables → [num_requests, max_blocks] int64, 0 (the null block) after each row's end."""
    width = max((len(t) for t in tables), default=0)
    out: np.ndarray = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out
