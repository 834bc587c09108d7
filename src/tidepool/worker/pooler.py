"""Poolers on the flat token stream: a pooling method, then a head chosen per request.

    hidden [num_tokens, hidden]  ──method──▶  pooled [num_seqs, hidden]   (CLS, MEAN, LAST, MAX)
                                 └─ALL────▶  per-sequence [len_i, hidden] (token tasks)
    pooled ──embed──▶ Dense modules → normalize → Matryoshka (truncate, renormalize)
           ──classify / score──▶ model.compute_logits → softmax (sigmoid for one label)
    per-sequence rows ──token_embed, token_classify, embed_sparse──▶ the token pooler of the
           model's output head for that task (output_heads/: one OutputHead per kind)

Everything a request's output needs is computed in one batched op per step where possible; the
per-request loop only slices.

Causal models may compute a prompt over several steps (chunked prefill). Each method then has a
chunked form: a partial value per chunk, folded into a running value, finished on the last chunk:

    MEAN: partial = sum of the chunk's rows, fold = add, finish = / prompt length
    LAST: partial = the chunk's last row, fold = keep the newer      (CLS keeps the older, MAX max)
    token tasks: the chunk's rows, fold = concatenate
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidepool.checkpoint.loader import DenseModule
from tidepool.config import ModelConfig
from tidepool.models.interfaces import ClassifierHead, EmbeddingPoolingHead, PoolingModel
from tidepool.output_heads import TokenPooler, get_head
from tidepool.params import PoolingParams


@dataclass(frozen=True)
class PoolingMetadata:
    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    """[num_seqs + 1] int64 on the model's device."""
    params: list[PoolingParams]
    input_ids: torch.Tensor | None = None
    """[num_tokens] the packed token ids (encoders; BGE-M3's sparse weights are per token id)."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def _seq_ids(meta: PoolingMetadata, device: torch.device) -> torch.Tensor:
    lens = torch.tensor(meta.seq_lens, device=device)
    return torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), lens)


def _pool_cls(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden.index_select(0, meta.cu_seqlens[:-1])


def _pool_last(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden.index_select(0, meta.cu_seqlens[1:] - 1)


def _membership(meta: PoolingMetadata, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[num_seqs, num_tokens] float32, 1 where the token belongs to the sequence.

    Built from cu_seqlens with two comparisons rather than a scatter of per-token sequence ids
    (a repeat_interleave, a zeros and an index_put: slower); one sequence is all
    ones. The matrix, and so the GEMM's result, is the same either way.
    """
    if meta.num_seqs == 1:
        return torch.ones(1, num_tokens, dtype=torch.float32, device=device)
    tokens = torch.arange(num_tokens, device=device)
    cu = meta.cu_seqlens
    return ((tokens >= cu[:-1, None]) & (tokens < cu[1:, None])).to(torch.float32)


def _segment_sums(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    """Per-sequence sums of the flat rows, float32: [num_seqs, hidden].

    One GEMM with a [num_seqs, num_tokens] 0/1 membership matrix: an order of magnitude faster
    than index_add_ (a scatter) on CPU (docs/performance.md, 'Choices elsewhere in the code').
    """
    return _membership(meta, hidden.shape[0], hidden.device) @ hidden.float()


def _pool_mean(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    sums = _segment_sums(hidden, meta)
    if meta.num_seqs == 1:  # the same division, without building a lengths tensor
        return sums.div_(meta.seq_lens[0])
    lens = torch.tensor(meta.seq_lens, device=hidden.device, dtype=torch.float32)
    return sums.div_(lens[:, None])


def _pool_max(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    index = _seq_ids(meta, hidden.device)[:, None].expand_as(hidden)
    out = hidden.new_full((meta.num_seqs, hidden.shape[1]), float("-inf"))
    return out.scatter_reduce_(0, index, hidden, "amax", include_self=True)


POOLING_METHODS: dict[str, Callable[[torch.Tensor, PoolingMetadata], torch.Tensor]] = {
    "CLS": _pool_cls,
    "LAST": _pool_last,
    "MEAN": _pool_mean,
    "MAX": _pool_max,
}


@dataclass(frozen=True)
class ChunkedMethod:
    """A pooling method over a sequence that arrives in chunks (see the module docstring)."""

    partial: Callable[[torch.Tensor, PoolingMetadata], torch.Tensor]
    """This step's rows → [num_seqs, hidden] partial values."""
    fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(running value of the earlier chunks, this chunk's partial) → running value."""
    finish: Callable[[torch.Tensor, int], torch.Tensor]
    """(running value, number of tokens of the sequence) → pooled [hidden]."""


CHUNKED_METHODS: dict[str, ChunkedMethod] = {
    "CLS": ChunkedMethod(_pool_cls, lambda old, new: old, lambda acc, n: acc),
    "LAST": ChunkedMethod(_pool_last, lambda old, new: new, lambda acc, n: acc),
    "MEAN": ChunkedMethod(_segment_sums, torch.add, lambda acc, n: acc / n),
    "MAX": ChunkedMethod(_pool_max, torch.maximum, lambda acc, n: acc),
}

PREFIX_CACHE_SAFE_METHODS = ("LAST",)
"""Methods that read only the last token: a prefix-cache hit (skipping the first tokens) is fine."""


def _own_pooling(config: ModelConfig, model: PoolingModel) -> EmbeddingPoolingHead | None:
    """The model's own embedding pooling, where it has one and nothing else is asked for."""
    st = config.st
    if config.task != "embed" or st.pooling_mode is not None or st.dense:
        return None
    return model if isinstance(model, EmbeddingPoolingHead) else None


def own_method(
    model: EmbeddingPoolingHead,
) -> Callable[[torch.Tensor, PoolingMetadata], torch.Tensor]:
    def pool(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
        assert meta.input_ids is not None, "the model's own pooling reads the token ids"
        return model.pool_embeddings(hidden, meta.cu_seqlens, meta.input_ids)

    return pool


class Pooler(nn.Module):
    """Turns a step's hidden states into one output tensor per request (on the CPU, float32)."""

    def __init__(self, model_config: ModelConfig, model: PoolingModel) -> None:
        super().__init__()
        st = model_config.st
        pooling_type = (st.pooling_mode or model.default_pooling_type).upper()
        own = _own_pooling(model_config, model)
        if own is not None:
            # The model's own embedding (CLIP's text towers: EOS token, projection), as its
            # library computes it, unless sentence-transformers metadata names a pooling.
            pooling_type = own.own_pooling_name
        elif pooling_type not in POOLING_METHODS:
            raise ValueError(
                f"pooling mode {pooling_type} is not supported; supported: {sorted(POOLING_METHODS)}"
            )
        self.pooling_type = pooling_type
        self._method = POOLING_METHODS[pooling_type] if own is None else own_method(own)
        tasks = model_config.pooling_tasks
        self._classifier = model if isinstance(model, ClassifierHead) else None
        if "classify" in tasks and self._classifier is None:
            raise TypeError(f"{type(model).__name__} has no classifier head (compute_logits)")
        head = get_head(model_config.output_head)
        self._model_kind = head.kind or f"this {model_config.task} model"
        """What the model is, for refusals ("a SPLADE sparse embedding model")."""
        self._head_model: Any = head.bind(model)
        """The model as its output head's protocol types it (checked here, at load)."""
        self._token_poolers: dict[str, TokenPooler[Any]] = {
            task: pooler for task, pooler in head.token_poolers.items() if task in tasks
        }
        """Task → the pooler of one text's rows, for the tasks that read every token."""
        self.model = model
        self.model_config = model_config
        self.task = model_config.task
        self.num_labels = model_config.num_labels
        self.dense: list[DenseModule] = [
            DenseModule(
                d.weight.to(model_config.device, torch.float32),
                None if d.bias is None else d.bias.to(model_config.device, torch.float32),
                d.activation,
            )
            for d in st.dense
        ]
        if not st.include_prompt and any(st.prompts.values()):
            logging.getLogger("tidepool").warning(
                "this model's Pooling has include_prompt=false; tidepool pools the prompt tokens "
                "too, so embeddings of prompted texts differ slightly from sentence-transformers"
            )
        # vLLM normalizes embeddings by default; a sentence-transformers pipeline without a
        # Normalize module says otherwise, and we honour it.
        self.default_normalize = st.normalize or not st.is_sentence_transformer
        if own is not None:
            self.embed_size = own.embedding_size
        else:
            self.embed_size = (
                self.dense[-1].weight.shape[0]
                if self.dense
                else model_config.hf_config.get_text_config().hidden_size
            )

    def supported_tasks(self) -> tuple[str, ...]:
        return self.model_config.pooling_tasks

    def check_params(self, params: PoolingParams) -> None:
        """Raise ValueError if this model cannot serve `params` (before any work is done)."""
        if params.task not in self.supported_tasks():
            raise ValueError(
                f"task {params.task!r} is not supported by {self._model_kind}; "
                f"supported: {', '.join(self.supported_tasks())}"
            )
        if params.dimensions is not None:
            if params.task not in ("embed", "token_embed"):
                raise ValueError("dimensions applies to embedding models only")
            if params.dimensions > self.embed_size:
                raise ValueError(
                    f"dimensions={params.dimensions} is larger than the model's embedding size "
                    f"{self.embed_size}"
                )
        if params.max_active_dims is not None and params.task != "embed_sparse":
            raise ValueError("max_active_dims applies to the embed_sparse task only")

    def apply_dense(self, x: torch.Tensor) -> torch.Tensor:
        for d in self.dense:
            x = F.linear(x, d.weight, d.bias)
            if d.activation == "tanh":
                x = torch.tanh(x)
            elif d.activation not in ("identity",):
                raise ValueError(f"unsupported Dense activation {d.activation}")
        return x

    def finish_embedding(self, x: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """x: [..., embed] float32 → normalized and truncated per the request."""
        # An explicit normalize=False wins, with or without dimensions (as vLLM).
        use = params.use_activation
        normalize = self.default_normalize if use is None else use
        if params.dimensions is not None:
            x = x[..., : params.dimensions]
        if normalize:
            x = F.normalize(x, p=2, dim=-1)
        return x

    def finish_logits(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.use_activation is False:
            return logits
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, meta: PoolingMetadata) -> list[torch.Tensor]:
        """Whole sequences: one output per sequence of `meta`."""
        outputs: list[torch.Tensor | None] = [None] * meta.num_seqs
        seq_rows = [i for i, p in enumerate(meta.params) if not self.reads_token_rows(p)]
        if seq_rows:
            pooled = self._method(hidden, meta)
            if len(seq_rows) != meta.num_seqs:
                pooled = pooled[seq_rows]
            for i, out in zip(
                seq_rows,
                self._finish_sequences(pooled, [meta.params[i] for i in seq_rows]),
                strict=True,
            ):
                outputs[i] = out
        if len(seq_rows) == meta.num_seqs:
            return outputs
        cu = meta.cu_seqlens.tolist()
        for i, p in enumerate(meta.params):
            token_pooler = self._token_pooler(p)
            if token_pooler is not None:
                ids = None if meta.input_ids is None else meta.input_ids[cu[i] : cu[i + 1]]
                rows = hidden[cu[i] : cu[i + 1]]
                outputs[i] = token_pooler(self._head_model, self, rows, ids, p)
        return outputs

    def _token_pooler(self, params: PoolingParams) -> TokenPooler[Any] | None:
        return self._token_poolers.get(params.task) if params.task else None

    def reads_token_rows(self, params: PoolingParams) -> bool:
        """True when the output is computed from each of its text's token rows (token tasks,
        sparse embeddings), not from one pooled row."""
        return self._token_pooler(params) is not None

    def reads_all_tokens(self, params: PoolingParams) -> bool:
        """True when the output needs every prompt token's hidden state (no prefix-cache reads)."""
        return self.reads_token_rows(params) or self.pooling_type not in PREFIX_CACHE_SAFE_METHODS

    @torch.inference_mode()
    def forward_chunks(
        self,
        hidden: torch.Tensor,
        meta: PoolingMetadata,
        running: list[Any],
        is_last: list[bool],
        num_tokens: list[int],
    ) -> tuple[list[torch.Tensor | None], list[Any]]:
        """One chunk per sequence of `meta` (causal models, chunked prefill).

        running[i]: sequence i's value from earlier chunks (None on its first chunk). Returns the
        outputs of the sequences whose last chunk this is (None for the others) and the new
        running values (None where finished).
        """
        outputs: list[torch.Tensor | None] = [None] * meta.num_seqs
        new_running: list[Any] = [None] * meta.num_seqs
        method = CHUNKED_METHODS[self.pooling_type]
        finished_rows: list[int] = []
        finished_values: list[torch.Tensor] = []
        seq_rows = [i for i, p in enumerate(meta.params) if not self.reads_token_rows(p)]
        if seq_rows:
            partial = method.partial(hidden, meta).float()
            for i in seq_rows:
                value = partial[i] if running[i] is None else method.fold(running[i], partial[i])
                if is_last[i]:
                    finished_rows.append(i)
                    finished_values.append(method.finish(value, num_tokens[i]))
                else:
                    new_running[i] = value
        if finished_rows:
            finished = self._finish_sequences(
                torch.stack(finished_values), [meta.params[i] for i in finished_rows]
            )
            for i, out in zip(finished_rows, finished, strict=True):
                outputs[i] = out
        cu = meta.cu_seqlens.tolist()
        for i, p in enumerate(meta.params):
            token_pooler = self._token_pooler(p)
            if token_pooler is not None:
                rows = hidden[cu[i] : cu[i + 1]]
                rows = rows if running[i] is None else torch.cat((running[i], rows))
                if is_last[i]:
                    outputs[i] = token_pooler(self._head_model, self, rows, None, p)
                else:
                    new_running[i] = rows
        return outputs, new_running

    def _finish_sequences(
        self, pooled: torch.Tensor, params: list[PoolingParams]
    ) -> list[torch.Tensor]:
        """pooled [n, hidden] → the head's output per sequence (on the CPU, float32)."""
        head: Callable[[torch.Tensor, PoolingParams], torch.Tensor]
        if self.task == "classify":
            assert self._classifier is not None  # a classify model has one (checked at load)
            head = self.finish_logits
            values = self._classifier.compute_logits(pooled).float()
        else:
            head = self.finish_embedding
            values = self.apply_dense(pooled.float())
        values = values.cpu()
        outputs: list[torch.Tensor | None] = [None] * len(params)
        # Requests with equal head parameters are finished in one batched op.
        groups: dict[tuple, list[int]] = {}
        for row, p in enumerate(params):
            groups.setdefault((p.use_activation, p.dimensions), []).append(row)
        for rows in groups.values():
            finished = head(values if len(rows) == len(params) else values[rows], params[rows[0]])
            for j, row in enumerate(rows):
                out = finished[j]
                if params[row].task == "score" and out.numel() == 1:
                    out = out[0]
                outputs[row] = out
        return outputs
