"""A causal step's flat batch: token ids, positions and the paged-attention metadata, built once.

Requests are laid out decodes first (longest context first), then prefill chunks (longest chunk
first), so that neighbours have similar shapes and attention runs them as a few padded buckets
(see attention/paged_metadata.py). Everything per token is computed with tensor ops; Python loops
run over requests only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from tidepool.attention.paged_metadata import (
    AttentionRow,
    AttentionView,
    PagedAttentionMetadata,
    build_group_metadata,
    causal_row_max_len,
    output_rows_of,
    plan_buckets,
    split_decode_rows,
    split_rows,
)
from tidepool.core.sched_output import SchedulerOutput
from tidepool.kv_cache.spec import KVCacheSpec
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
    attn_metadata: PagedAttentionMetadata
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
    dtype: torch.dtype,
    device: torch.device,
    max_pad_fraction: float,
    output_rows_only: bool = False,
    in_place_decode_len: int = 0,
) -> CausalBatch:
    """`output_rows_only`: the step reads only finishing requests' last tokens (sampling, LAST
    pooling): the metadata carries them (PagedAttentionMetadata.output_rows).
    `in_place_decode_len`: rows of at most this many queries (decodes, short prompts, the output
    rows) read the cache in place (attention/cpu_paged_decode.py) instead of SDPA buckets; 0:
    none."""
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

    rows = split_rows(
        context_lens, query_lens, causal_max_len=causal_row_max_len([v.spec for v in views])
    )
    first_spec = views[0].spec
    plans = [_plan_rows(rows, first_spec, max_pad_fraction, in_place_decode_len)]
    reaches_end = [
        c + q >= r.num_tokens for r, c, q in zip(requests, context_lens, query_lens, strict=True)
    ]
    out_tokens: list[int] = []
    if output_rows_only:
        out_tokens, out_rows = output_rows_of(context_lens, query_lens, reaches_end)
        plans.append(_plan_rows(out_rows, first_spec, max_pad_fraction, in_place_decode_len))
    tables = _block_tables(requests, states, views, int32=in_place_decode_len > 0)
    groups = [
        tuple(
            build_group_metadata(
                plan.rows,
                plan.spans,
                tables[group_id][0],
                token_request,
                positions,
                spec,
                dtype,
                device,
                plan.decode_rows,
                tables[group_id][1],
            )
            for group_id, spec in views
        )
        for plan in plans
    ]
    attn_metadata = PagedAttentionMetadata(
        num_tokens,
        groups[0],
        layer_views,
        torch.tensor(out_tokens, dtype=torch.int64).to(device) if output_rows_only else None,
        groups[1] if output_rows_only else (),
    )
    return CausalBatch(
        requests=requests,
        query_lens=query_lens,
        context_lens=context_lens,
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=positions.to(device, non_blocking=True),
        cu_query_lens=cu.to(device, non_blocking=True),
        attn_metadata=attn_metadata,
        reaches_end=reaches_end,
    )


class _RowPlan(NamedTuple):
    rows: list[AttentionRow]
    """Rows for the SDPA buckets."""
    spans: list[tuple[int, int]]
    decode_rows: list[AttentionRow]
    """Rows for the in-place kernel."""


def _plan_rows(
    rows: list[AttentionRow], spec: KVCacheSpec, max_pad_fraction: float, in_place_len: int
) -> _RowPlan:
    bucketed, in_place = split_decode_rows(rows, in_place_len)
    spans = plan_buckets(bucketed, spec.block_size, spec.num_kv_heads, max_pad_fraction)
    return _RowPlan(bucketed, spans, in_place)


def _block_tables(
    requests: list[Request], states: RequestStates, views: Sequence[AttentionView], int32: bool
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """group id → its [requests, max_blocks] block table, int64 (and int32 for the kernel)."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for group_id, _ in views:
        if group_id not in out:
            table = torch.from_numpy(
                _pad_table([states[r.request_id].block_ids[group_id] for r in requests])
            )
            out[group_id] = (table, table.to(torch.int32) if int32 else None)
    return out


def _token_layout(
    query_lens: list[int], context_lens: list[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_query_lens [requests + 1], position [tokens], request index [tokens]), int64 CPU
    tensors. numpy's repeat, not torch.repeat_interleave: the latter took ~6 ms a call at 64
    decodes on the 2-core machine (two calls: ~1% of a decode step)."""
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
