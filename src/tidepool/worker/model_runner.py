"""SchedulerOutput → flat batch → model → output stage → ModelRunnerOutput.

One runner body for every model; the output stage is the pooler (pooling runner) or the LM head
and the sampler (generating runner). Encoders run each prompt whole through bucketed
bidirectional attention; causal models run over the paged KV cache, whose tensors the runner
allocates and owns (the scheduler sees block ids only).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, cast

import torch

from tidepool.attention.abstract import DecoderAttentionBackend
from tidepool.attention.backend import check_provides
from tidepool.attention.common import AttentionMetadataBuilder, encoder_step
from tidepool.attention.paged import allocate_kv_caches
from tidepool.attention.paged_metadata import AttentionView
from tidepool.config import EngineConfig, ModelConfig
from tidepool.core.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from tidepool.kv_cache.spec import KVCacheConfig, group_layers, plan_kv_cache
from tidepool.model_loader.registry import build_model
from tidepool.models.interfaces import DecoderModel, EncoderModel, LanguageModelHead, MRopeModel
from tidepool.params import PoolingParams
from tidepool.request import Request
from tidepool.utils.lists import filled
from tidepool.worker.input_batch import CausalBatch, RequestStates, build_causal_batch
from tidepool.worker.memory import NativeMemory
from tidepool.worker.mrope import MRopeStates
from tidepool.worker.multimodal import MultiModalRunner
from tidepool.worker.pooler import Pooler, PoolingMetadata
from tidepool.worker.sampler import Sampler, SamplingMetadata

logger = logging.getLogger("tidepool")

# CPU encoder steps up to this many tokens run on one thread: their ops are so short that waking
# the other OpenMP threads (they sleep between ops under OMP_WAIT_POLICY=PASSIVE) costs more
# than it saves; the limits per dtype are where two threads stopped losing (the measurements:
# docs/performance.md, "One short text", "The second thread").
SINGLE_THREAD_MAX_TOKENS = {torch.float32: 64, torch.bfloat16: 192, torch.float16: 192}
SINGLE_THREAD_MAX_TOKENS_QUANTIZED = {"int8": 96}
"""The same limit for a quantized model (its dtype is float32: the activations' dtype)."""


def single_thread_max_tokens(dtype: torch.dtype, quantization: str | None = None) -> int:
    if quantization is not None:
        return SINGLE_THREAD_MAX_TOKENS_QUANTIZED.get(quantization, 0)
    return SINGLE_THREAD_MAX_TOKENS.get(dtype, 0)


@contextlib.contextmanager
def _threads_for_step(
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> Iterator[None]:
    threads = torch.get_num_threads()
    if (
        device.type != "cpu"
        or threads == 1
        or num_tokens > single_thread_max_tokens(dtype, quantization)
    ):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Before the model loads: its weight packing creates the first oneDNN primitives.
        self.memory = NativeMemory.start(config.model.dtype, config.model.quantization)
        self.device = config.model.device
        torch.manual_seed(config.model.seed)
        self.model = _check_contract(build_model(config.model), config.model)
        self.pooler = Pooler(config.model, self.model)
        self.multimodal = MultiModalRunner.for_model(self.model, self.pooler)
        """Images: encoder cache and scatter (worker/multimodal.py); None for a text model."""
        # Sizes attention buckets; a model without attention heads (FNet, on the fallback): 1.
        self.num_heads = int(getattr(config.model.hf_config, "num_attention_heads", None) or 1)
        # positions are 0..len-1 per sequence: slices of one arange, made once.
        self._arange = torch.arange(config.model.max_model_len, dtype=torch.int64)
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.attention_views: tuple[AttentionView, ...] = ()
        self.layer_groups: tuple[int, ...] = ()
        """Layer index (among KV-cache layers) → its attention view."""
        self._attn_builder: tuple[Any, AttentionMetadataBuilder[Any]] | None = None
        """(backend, its metadata builder): made at load (_init_kv_cache / the first step's
        check), again only if the model was handed another backend since."""
        self.states = RequestStates(device=self.device)
        self.mrope = (
            MRopeStates(self.model, self.device)
            if isinstance(self.model, MRopeModel) and self.model.uses_mrope
            else None
        )
        self.sampler = Sampler() if config.model.runner_type == "generate" else None
        if config.model.is_causal:
            self._init_kv_cache()
        self.attn_builder  # noqa: B018  # made now, with the backend chosen at load

    # ------------------------------------------------------------------ KV cache

    def _init_kv_cache(self) -> None:
        cache, model_config = self.config.cache, self.config.model
        model = cast(DecoderModel, self.model)  # _check_contract: causal → DecoderModel
        specs = model.kv_cache_specs(cache.block_size, model_config.dtype)
        groups = group_layers(specs, uniform=cache.disable_hybrid_kv_cache_manager)
        kv_bytes, fraction = cache.budget(self.device)
        kv_config = plan_kv_cache(groups, kv_bytes, fraction, device=self.device)
        # More blocks than max_num_seqs full-length requests can hold at once only feed the prefix
        # cache; cap there, so a small model does not map gigabytes it never uses.
        sched = self.config.scheduler
        per_request = sum(
            g.spec.max_num_blocks_per_request(
                model_config.max_model_len, sched.max_num_batched_tokens
            )
            for g in groups
        )
        cap = sched.max_num_seqs * per_request + 1
        if kv_config.num_blocks > cap:
            kv_config = replace(kv_config, num_blocks=cap)
        backend = model.attention_backend
        caches = allocate_kv_caches(kv_config, specs, self.device, backend.kv_cache_shape)
        group_of = {
            name: g for g, group in enumerate(kv_config.groups) for name in group.layer_names
        }
        layer_specs = {name: spec for name, spec in specs.items() if spec is not None}
        names = list(layer_specs)
        self.kv_caches = [caches[name] for name in names]
        # One attention view per (group, layer spec): a layer keeps its own window even where the
        # uniform layout put it in a full-attention group.
        views: dict[AttentionView, int] = {}
        for name in names:
            views.setdefault(AttentionView(group_of[name], layer_specs[name]), len(views))
        self.attention_views = tuple(views)
        self.layer_groups = tuple(
            views[AttentionView(group_of[name], layer_specs[name])] for name in names
        )
        self.kv_cache_config = kv_config
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), %d group(s)",
            kv_config.num_blocks,
            kv_config.block_size,
            kv_config.num_blocks * kv_config.bytes_per_block / 2**20,
            len(kv_config.groups),
        )

    @property
    def attn_builder(self) -> AttentionMetadataBuilder[Any]:
        """The model's attention backend's metadata builder (attention/common.py): the step's
        neutral description → the backend's metadata, once per step."""
        backend = self.model.attention_backend
        if self._attn_builder is None or self._attn_builder[0] is not backend:
            if self.kv_cache_config is None:
                spec = self.model.attention_spec(self.device, self.config.model.dtype)
                check_provides(backend, spec, type(self.model).__name__)  # handed over after load
                builder = cast(EncoderModel, self.model).attention_backend.metadata_builder()
            else:
                builder = self._decoder_builder(cast(DecoderModel, self.model).attention_backend)
            self._attn_builder = (backend, builder)
        return self._attn_builder[1]

    def _decoder_builder(self, backend: DecoderAttentionBackend) -> AttentionMetadataBuilder[Any]:
        """The builder of `backend`, which must lay the allocated cache out as its views are."""
        num_blocks = cast(KVCacheConfig, self.kv_cache_config).num_blocks
        for cache, view in zip(self.kv_caches, self.layer_groups, strict=True):
            shape = backend.kv_cache_shape(num_blocks, self.attention_views[view].spec)
            if tuple(cache.shape) != shape:
                raise ValueError(
                    f"attention backend {backend.name!r} lays the KV cache out as {shape}, "
                    f"not as the allocated {tuple(cache.shape)}: choose it before the cache "
                    "is allocated (at load)"
                )
        return backend.metadata_builder([spec for _, spec in self.attention_views], self.device)

    # ------------------------------------------------------------------ execute

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.memory.after_step()
        if self.kv_cache_config is None:
            num_tokens = sum(r.num_prompt_tokens for r in sched_out.scheduled)
            model_config = self.config.model
            with _threads_for_step(
                num_tokens, model_config.dtype, self.device, model_config.quantization
            ):
                return ModelRunnerOutput(pooled=self._execute_encoder(sched_out))
        self.states.update(sched_out)
        if self.multimodal is not None:
            self.multimodal.free(sched_out.finished_req_ids | sched_out.restarted_req_ids)
        if sched_out.is_empty:
            return ModelRunnerOutput()
        batch = build_causal_batch(
            sched_out,
            self.states,
            self.attention_views,
            self.layer_groups,
            self.attn_builder,
            self.config.model.dtype,
            self.device,
            output_rows_only=self._reads_last_rows_only(sched_out),
        )
        model = cast(DecoderModel, self.model)  # _check_contract: causal → DecoderModel
        positions = batch.positions
        if self.mrope is not None:  # three rows per token (worker/mrope.py)
            positions = self.mrope.step_positions(
                sched_out, batch.requests, batch.context_lens, batch.query_lens
            )
        hidden = model(
            batch.input_ids,
            positions,
            batch.attn_metadata,
            self.kv_caches,
            **self._inputs_embeds(
                batch.input_ids, batch.requests, batch.context_lens, batch.query_lens
            ),
        )
        output_rows = batch.attn_metadata.output_rows
        if output_rows is not None and hidden.shape[0] != output_rows.shape[0]:
            hidden = hidden.index_select(0, output_rows)  # the model computed every row
        if self.sampler is not None:
            return ModelRunnerOutput(sampled=self._sample(hidden, batch))
        if output_rows is not None:
            return ModelRunnerOutput(pooled=self._pool_last_rows(hidden, batch))
        return ModelRunnerOutput(pooled=self._pool_chunks(hidden, batch))

    def _reads_last_rows_only(self, sched_out: SchedulerOutput) -> bool:
        """Sampling, or LAST pooling with no token outputs: the step reads each finishing
        request's last hidden state and nothing else (PagedAttentionMetadata.output_rows)."""
        if self.sampler is not None:
            return True
        return not any(
            self.pooler.reads_all_tokens(p) for p in _pooling_params(sched_out.scheduled)
        )

    def _execute_encoder(self, sched_out: SchedulerOutput) -> dict[str, torch.Tensor]:
        # Longest first, so that sequences of similar length are neighbours: attention runs them
        # as a few padded buckets instead of one call per sequence (see attention/metadata.py).
        requests = sorted(sched_out.scheduled, key=lambda r: -r.num_prompt_tokens)
        pooled: dict[str, torch.Tensor] = {}
        if self.multimodal is not None:  # a dual tower's image requests: its vision side
            requests, pooled = self.multimodal.pool_image_requests(requests)
            if not requests:
                return pooled
        seq_lens = [r.num_prompt_tokens for r in requests]
        device = self.device
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(r.prompt_token_ids for r in requests)),
            dtype=torch.int64,
        )
        positions = torch.cat(
            [
                self._arange[r.first_position : r.first_position + r.num_prompt_tokens]
                for r in requests
            ]
        )
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
        step = encoder_step(
            seq_lens, device, self.config.model.dtype, self.num_heads, _key_lens(requests)
        )
        attn_meta = self.attn_builder.build(step)
        params = _pooling_params(requests)
        model = cast(EncoderModel, self.model)  # _check_contract: not causal → EncoderModel
        embeds = self._inputs_embeds(input_ids, requests, [0] * len(seq_lens), seq_lens)
        if self._pools_first_tokens_only(params):
            # hidden: [num_seqs, hidden], each sequence's first token; to the pooler every
            # sequence is then one row long, and CLS pooling reads that row.
            num_seqs = len(seq_lens)
            hidden = model(
                input_ids, positions, attn_meta, token_type_ids, first_token_only=True, **embeds
            )
            pool_meta = PoolingMetadata(
                seq_lens=[1] * num_seqs,
                cu_seqlens=torch.arange(num_seqs + 1, dtype=torch.int64, device=device),
                params=params,
            )
        else:
            hidden = model(input_ids, positions, attn_meta, token_type_ids, **embeds)
            cu_seqlens = step.query_start_loc.to(device, non_blocking=True)
            pool_meta = PoolingMetadata(seq_lens, cu_seqlens, params, input_ids)
        outputs = self.pooler(hidden, pool_meta)
        pooled.update((r.request_id, out) for r, out in zip(requests, outputs, strict=True))
        return pooled

    def _inputs_embeds(
        self,
        input_ids: torch.Tensor,
        requests: Sequence[Request],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """{"inputs_embeds": the step's embeddings with its images' rows} where the step
        schedules image placeholders (worker/multimodal.py), else {} (the model looks up ids)."""
        if self.multimodal is None:
            return {}
        embeds = self.multimodal.inputs_embeds(input_ids, requests, context_lens, query_lens)
        return {} if embeds is None else {"inputs_embeds": embeds}

    def _pools_first_tokens_only(self, params: list[PoolingParams]) -> bool:
        """True when the step's outputs read only each sequence's first token (CLS pooling, no
        token task) and the model can compute only those rows in its last layer."""
        return (
            cast(EncoderModel, self.model).supports_first_token_only
            and self.pooler.pooling_type == "CLS"
            and not any(self.pooler.reads_token_rows(p) for p in params)
        )

    def _pool_chunks(self, hidden: torch.Tensor, batch: CausalBatch) -> dict[str, torch.Tensor]:
        """Pooling on a causal model: every scheduled request is a pooling request."""
        meta = PoolingMetadata(
            seq_lens=batch.query_lens,
            cu_seqlens=batch.cu_query_lens,
            params=_pooling_params(batch.requests),
        )
        states = [self.states[r.request_id] for r in batch.requests]
        outputs, running = self.pooler.forward_chunks(
            hidden,
            meta,
            [s.pooling_running for s in states],
            batch.reaches_end,
            [r.num_prompt_tokens for r in batch.requests],
        )
        pooled: dict[str, torch.Tensor] = {}
        for request, state, out, value in zip(
            batch.requests, states, outputs, running, strict=True
        ):
            state.pooling_running = value
            if out is not None:
                pooled[request.request_id] = out
        return pooled

    def _pool_last_rows(self, hidden: torch.Tensor, batch: CausalBatch) -> dict[str, torch.Tensor]:
        """LAST pooling from output rows: hidden [num_finishing, hidden], one row per request
        whose prompt ends in this step (the others need nothing from it)."""
        requests = [r for r, end in zip(batch.requests, batch.reaches_end, strict=True) if end]
        if not requests:
            return {}
        num_rows = len(requests)
        meta = PoolingMetadata(
            seq_lens=[1] * num_rows,
            cu_seqlens=torch.arange(num_rows + 1, dtype=torch.int64, device=hidden.device),
            params=_pooling_params(requests),
        )
        outputs, _ = self.pooler.forward_chunks(
            hidden,
            meta,
            [None] * num_rows,
            [True] * num_rows,
            [r.num_prompt_tokens for r in requests],
        )
        return {
            r.request_id: out for r, out in zip(requests, outputs, strict=True) if out is not None
        }

    def _sample(self, hidden: torch.Tensor, batch: CausalBatch) -> dict[str, SampledToken]:
        """hidden [num_finishing, hidden] (the step's output rows): the last row of each request
        that samples now."""
        requests = [r for r, end in zip(batch.requests, batch.reaches_end, strict=True) if end]
        if not requests:
            return {}
        head = cast(LanguageModelHead, self.model)  # _check_contract: generate → an LM head
        logits = head.compute_logits(hidden)
        generators = {}
        for row, request in enumerate(requests):
            generator = self.states[request.request_id].generator
            if generator is not None:
                generators[row] = generator
        meta = SamplingMetadata.build(
            filled([r.sampling_params for r in requests]),
            [r.output_token_ids for r in requests],
            [r.prompt_token_ids for r in requests],
            [_stop_token_ids(r) for r in requests],
            generators,
            logits.shape[1],
        )
        assert self.sampler is not None  # _sample runs on generating models only
        out = self.sampler(logits, meta)
        return {
            r.request_id: SampledToken(token, logprobs)
            for r, token, logprobs in zip(requests, out.token_ids, out.logprobs, strict=True)
        }


_CONTRACTS: dict[bool, type] = {False: EncoderModel, True: DecoderModel}
"""is_causal → the Protocol (models/interfaces.py) the runner holds the model to."""


def _check_contract(model: Any, config: ModelConfig) -> EncoderModel | DecoderModel:
    """The model declares what this runner will call (checked once, at load)."""
    contract = _CONTRACTS[config.is_causal]
    if model.is_causal != config.is_causal or not isinstance(model, contract):
        raise TypeError(
            f"{type(model).__name__} does not implement the {contract.__name__} contract"
        )
    if config.runner_type == "generate" and not isinstance(model, LanguageModelHead):
        raise TypeError(f"{type(model).__name__} has no LM head (compute_logits) to generate with")
    return cast(EncoderModel | DecoderModel, model)


def _key_lens(requests: list[Request]) -> list[int] | None:
    """Each prompt's number of keys (metadata.key_lens), or None when every token is one."""
    if all(r.num_attended_tokens is None for r in requests):
        return None
    return [r.num_attended_tokens or r.num_prompt_tokens for r in requests]


def _stop_token_ids(request) -> list[int]:
    """Tokens that end the request (masked while it has fewer than min_tokens outputs)."""
    params = request.sampling_params
    ids = [] if params.ignore_eos else list(request.eos_token_ids)
    return ids + list(params.stop_token_ids)


def _pooling_params(requests: Sequence[Request]) -> list[PoolingParams]:
    """The params of a pooling step's requests (the scheduler gives a pooling model no other)."""
    return filled([r.pooling_params for r in requests])
