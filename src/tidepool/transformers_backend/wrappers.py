"""tidepool's model contract (models/interfaces.py) around a Hugging Face model (the transformers
backend).

    TransformersEncoderModel  an EncoderModel: forward(input_ids, positions, the backend's
                              step metadata, token_type_ids); no first-token-only path
    TransformersDecoderModel  a DecoderModel: forward(input_ids, positions, PagedAttentionMetadata,
                              kv_caches) + kv_cache_specs(block_size, dtype)
    both                      → hidden [num_tokens, hidden]; compute_logits(pooled / last states)

The HF body runs on the flat batch as one sequence [1, num_tokens]; the step's attention metadata
rides in the call's keyword arguments to `tidepool_attention` (transformers_attention.py). Heads
run as HF wrote them (HeadRunner).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tidepool.attention import cpu_kernels
from tidepool.attention.backend import (
    BUCKETED_SDPA,
    PAGED_SDPA,
    AttentionSpec,
    DecoderAttentionBackend,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.layer import AttentionModel
from tidepool.attention.paged_metadata import PagedAttentionMetadata
from tidepool.config import ModelConfig
from tidepool.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from tidepool.transformers_backend.attention import (
    STEP_KWARG,
    DecoderStep,
    EncoderStep,
    ObservedLayer,
    ProbeStep,
    UnsupportedAttentionError,
)


def attention_modules(hf_model: nn.Module) -> list[nn.Module]:
    """The modules that call the attention function (what HF records as "attentions")."""
    recorded = getattr(hf_model, "_can_record_outputs", None) or {}
    target = recorded.get("attentions")
    target_class = getattr(target, "target_class", target)
    if isinstance(target_class, type):
        found = [m for m in hf_model.modules() if isinstance(m, target_class)]
        if found:
            return found
    return [
        m
        for m in hf_model.modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")
    ]


# ----------------------------------------------------------------------------- heads


@dataclass
class _BodyOutput:
    """What the stand-in body returns: the states given to it (and BERT-style pooler output)."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None

    def __getitem__(self, index: int) -> torch.Tensor:
        # HF heads index outputs as tuples without the None entries (outputs[1] = pooler output).
        return tuple(t for t in (self.last_hidden_state, self.pooler_output) if t is not None)[
            index
        ]

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None  # cache, past_key_values, hidden_states, attentions: not computed


class _StandInBody(nn.Module):
    """Returns its `inputs_embeds` (the pooled or selected states) as the body's output."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        pooler = getattr(body, "pooler", None)
        self.pooler = pooler if isinstance(pooler, nn.Module) else None
        self._signature = inspect.signature(body.forward)

    def forward(self, *args: Any, **kwargs: Any) -> _BodyOutput:
        states = self._signature.bind_partial(*args, **kwargs).arguments["inputs_embeds"]
        pooled = None if self.pooler is None else self.pooler(states)
        return _BodyOutput(states, pooled)


class HeadRunner:
    """The HF model's head on pooled states: [num_seqs, hidden] → [num_seqs, out].

    Calls the HF model's own forward with `inputs_embeds = states[:, None]` (one token per
    sequence) and its body swapped for `_StandInBody`, in a shallow copy that shares every weight.
    So whatever the head does (BERT's pooler + classifier, DistilBERT's pre_classifier + ReLU,
    ModernBERT's head, Granite's logits scaling, a decoder's score on the last token) is HF's code.
    """

    def __init__(self, hf_model: nn.Module, is_causal: bool) -> None:
        prefix = getattr(hf_model, "base_model_prefix", "")
        if prefix not in hf_model._modules:
            raise UnsupportedAttentionError(
                f"{type(hf_model).__name__}: cannot find its body ({prefix!r}) to run the head alone"
            )
        view = copy.copy(hf_model)
        view._modules = dict(hf_model._modules)  # its own child table; the children are shared
        view._modules[prefix] = _StandInBody(hf_model._modules[prefix])
        self._view = view
        pad = getattr(hf_model.config, "pad_token_id", None)
        self._token_id = 1 if pad == 0 else 0  # any non-pad id: "the last token is the real one"
        # Without a pad id, HF's decoder classifiers refuse batches larger than one.
        self._one_row_at_a_time = pad is None and is_causal

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        if self._one_row_at_a_time:
            return torch.cat([self._run(row[None]) for row in states])
        return self._run(states)

    def _run(self, states: torch.Tensor) -> torch.Tensor:
        num_seqs = states.shape[0]
        ids = torch.full((num_seqs, 1), self._token_id, dtype=torch.int64, device=states.device)
        logits = self._view(input_ids=ids, inputs_embeds=states[:, None, :]).logits
        return logits.reshape(num_seqs, -1)


# ----------------------------------------------------------------------------- wrappers


def _check_attention_calls(
    step: EncoderStep | DecoderStep | ProbeStep, expected: int, model: str
) -> None:
    if len(step.modules_called) != expected:
        raise UnsupportedAttentionError(
            f"{model}: {len(step.modules_called)} of its {expected} attention layers called "
            "tidepool's attention; the others compute attention another way"
        )


def _embeddings_in_chunks(hf_model: nn.Module, limit: int) -> None:
    """Run the body's embedding module (the parent of its input embeddings) on pieces of at most
    `limit` tokens when a step is longer: the packed batch is one row [1, num_tokens], and some
    embedding modules check that row against max_position_embeddings (CLIP's: "Sequence length
    must be less than max_position_embeddings"), a per-sequence limit that packed steps exceed.
    Embedding modules work token by token (lookups, adds, LayerNorm), so the pieces' outputs,
    concatenated, are the whole row's. Patched on the instance: names and weights unchanged."""
    body = hf_model.base_model
    try:
        tokens = body.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    parent = next(
        (m for m in body.modules() if m is not body and any(c is tokens for c in m.children())),
        None,
    )
    if parent is None or limit <= 0:
        return  # token embeddings owned by the body itself: it computes positions (RoPE, ...)
    forward = parent.forward

    def forward_in_chunks(*args: Any, **kwargs: Any) -> torch.Tensor:
        rows = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 1]
        length = rows[0].shape[1] if rows else 0
        if length <= limit:
            return forward(*args, **kwargs)

        def piece(x: Any, start: int) -> Any:
            along = isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[1] == length
            return x[:, start : start + limit] if along else x

        pieces = []
        for start in range(0, length, limit):
            out = forward(
                *(piece(a, start) for a in args), **{k: piece(v, start) for k, v in kwargs.items()}
            )
            if not isinstance(out, torch.Tensor):
                raise UnsupportedAttentionError(
                    f"{type(parent).__name__} returns {type(out).__name__}, not one tensor: "
                    "tidepool cannot run it on steps longer than max_position_embeddings"
                )
            pieces.append(out)
        return torch.cat(pieces, dim=1)

    parent.forward = forward_in_chunks


class TransformersEncoderModel(AttentionModel, nn.Module):
    """A HF encoder on the packed batch (no KV cache): bidirectional, or causal where its layers
    ask for it (CLIP's text tower)."""

    is_causal: ClassVar[bool] = False
    supports_first_token_only: ClassVar[bool] = False
    """HF's layers compute every row; CLS pooling reads the first one."""

    def __init__(self, hf_model: nn.Module, config: ModelConfig, position_offset: int) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.position_offset = position_offset
        body = hf_model.base_model
        self._takes_token_type_ids = "token_type_ids" in inspect.signature(body.forward).parameters
        self._num_attention_layers = len(attention_modules(hf_model))
        self.default_pooling_type = "CLS"
        classifier_pooling = str(getattr(hf_model.config, "classifier_pooling", "")).upper()
        if config.task == "classify" and classifier_pooling in ("CLS", "MEAN"):
            self.default_pooling_type = classifier_pooling  # ModernBERT pools before its head
        self._head = HeadRunner(hf_model, is_causal=False) if config.task != "embed" else None
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA
        """Chosen by the loader (attention/backend.py)."""
        limit = int(getattr(hf_model.config, "max_position_embeddings", 0) or 0)
        _embeddings_in_chunks(hf_model, limit)

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        config = self.hf_model.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        max_len = int(getattr(config, "max_position_embeddings", 0) or 0)
        return AttentionSpec(device, dtype, head_dim, max_len or cpu_kernels.MAX_SEQ_LEN)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        if first_token_only:
            raise ValueError("supports_first_token_only is False: every row is computed")
        # The HF body runs on the rows the backend's builder chose (packed tokens, or padded
        # buckets' slots: attention/common.py LayerRows) as one sequence.
        rows = attn_metadata.rows
        step = EncoderStep(attn_metadata, self.attention_backend)
        kwargs: dict[str, Any] = {STEP_KWARG: step}
        if self._takes_token_type_ids:
            # Always explicit: HF's default slices a buffer of max_position_embeddings zeros,
            # shorter than a packed batch.
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            kwargs["token_type_ids"] = rows.gather(types)[None]
        if self.position_offset:
            positions = positions + self.position_offset
        ids, pos = rows.gather(input_ids), rows.gather(positions)
        out = self.hf_model.base_model(input_ids=ids[None], position_ids=pos[None], **kwargs)
        _check_attention_calls(step, self._num_attention_layers, type(self.hf_model).__name__)
        return rows.to_tokens(out[0][0])

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [num_seqs, hidden] → [num_seqs, num_labels] through the HF classifier."""
        assert self._head is not None, "an embedding model has no head"
        return self._head(pooled)

    def compute_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """*ForTokenClassification: hidden [num_tokens, hidden] → [num_tokens, num_labels], the
        HF head on each token as a one-token sequence (its head reads each row alone)."""
        assert self._head is not None, "an embedding model has no head"
        return self._head(hidden)


EOS_POOLED_ENCODERS: dict[str, str | None] = {
    "CLIPTextModel": None,
    "CLIPTextModelWithProjection": "text_projection",
}
"""HF classes whose embedding is the EOS token's state (their pooler_output), then the named
projection (text_embeds): transformers' CLIP text towers, as CLIPModel.get_text_features and
sentence-transformers' CLIP module compute it."""


class EosPooling:
    """An EmbeddingPoolingHead (models/interfaces.py) for the HF classes of EOS_POOLED_ENCODERS:
    the state at each sequence's EOS token as transformers picks it, through the tower's
    projection when it has one. Mixed into the backend's and the fallback's encoder wrappers."""

    own_pooling_name = "EOS"
    embedding_size: int
    _projection: nn.Module | None
    _eos_token_id: int | None

    def _init_eos_pooling(self, hf_model: nn.Module) -> None:
        projection = EOS_POOLED_ENCODERS[type(hf_model).__name__]
        self._projection = None if projection is None else getattr(hf_model, projection)
        eos = getattr(hf_model.base_model, "eos_token_id", hf_model.config.eos_token_id)
        self._eos_token_id = None if eos is None else int(eos)
        width = hf_model.config.hidden_size
        if self._projection is not None:
            width = self._projection.out_features
        self.embedding_size = int(width)

    def pool_embeddings(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """transformers' rule (CLIPTextModel.forward): with the legacy eos_token_id 2, the first
        position of the sequence's largest id (the EOS of CLIP's vocabulary); else the first
        position of eos_token_id, the sequence's first token where there is none."""
        num_tokens, num_seqs = hidden.shape[0], cu_seqlens.numel() - 1
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=hidden.device), lens)
        if self._eos_token_id == 2:
            lowest = torch.iinfo(input_ids.dtype).min
            seq_max = input_ids.new_full((num_seqs,), lowest)
            seq_max = seq_max.scatter_reduce(0, seq, input_ids, "amax")
            match = input_ids == seq_max[seq]
        elif self._eos_token_id is None:  # transformers compares with None: no match anywhere
            match = torch.zeros_like(input_ids, dtype=torch.bool)
        else:
            match = input_ids == self._eos_token_id
        position = torch.arange(num_tokens, device=hidden.device)
        candidates = torch.where(match, position, num_tokens)
        first = candidates.new_full((num_seqs,), num_tokens)
        first = first.scatter_reduce(0, seq, candidates, "amin")
        first = torch.where(first == num_tokens, cu_seqlens[:-1], first)
        pooled = hidden.index_select(0, first)
        return pooled if self._projection is None else self._projection(pooled)


class TransformersEosPooledEncoder(EosPooling, TransformersEncoderModel):
    """A CLIP text tower on the backend: causal layers (the call's is_causal), EOS pooling."""

    def __init__(self, hf_model: nn.Module, config: ModelConfig, position_offset: int) -> None:
        super().__init__(hf_model, config, position_offset)
        # Where sentence-transformers metadata names no pooling, the pooler calls
        # pool_embeddings; its Pooling module's mode otherwise (LAST: where CLIP's EOS is).
        self.default_pooling_type = "LAST"
        self._init_eos_pooling(hf_model)


class TransformersDecoderModel(AttentionModel, nn.Module):
    """A causal HF decoder over the paged KV cache (chunked prefill, prefix caching)."""

    is_causal: ClassVar[bool] = True
    default_pooling_type: ClassVar[str] = "LAST"

    def __init__(self, hf_model: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.max_model_len = config.max_model_len
        observed = self._probe(hf_model, len(attention_modules(hf_model)))
        self._layer_ids = sorted(observed)
        self._layers = [observed[i] for i in self._layer_ids]
        self._cache_index = {layer_idx: i for i, layer_idx in enumerate(self._layer_ids)}
        self._declared_windows = tuple(layer.sliding_window for layer in self._layers)
        self._head = HeadRunner(hf_model, is_causal=True) if config.task != "embed" else None
        self.attention_backend: DecoderAttentionBackend = PAGED_SDPA
        """Chosen by the loader (attention/backend.py)."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        max_len = int(getattr(self.hf_model.config, "max_position_embeddings", 0) or 0)
        head_size = self._layers[0].head_size  # as the layers pass it (the probe)
        return AttentionSpec(device, dtype, head_size, max_len or self.max_model_len)

    @staticmethod
    @torch.inference_mode()
    def _probe(hf_model: nn.Module, num_attention_layers: int) -> dict[int, ObservedLayer]:
        """layer_idx → KV heads, head size, window, as the layers pass them (a 2-token dry run)."""
        step = ProbeStep()
        device = next(hf_model.parameters()).device
        hf_model.base_model(
            input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device),
            position_ids=torch.arange(2, device=device)[None],
            use_cache=False,
            **{STEP_KWARG: step},
        )
        _check_attention_calls(step, num_attention_layers, type(hf_model).__name__)
        return step.layers

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec | None]:
        """One spec per attention layer, in layer order. A window at least max_model_len long
        never drops a key, so such layers keep a full-attention cache."""
        specs: dict[str, KVCacheSpec | None] = {}
        for layer_idx, layer in zip(self._layer_ids, self._layers, strict=True):
            window, kv_heads, head_size = layer.sliding_window, layer.num_kv_heads, layer.head_size
            if window is not None and window < self.max_model_len:
                spec: KVCacheSpec = SlidingWindowSpec(
                    block_size, kv_heads, head_size, dtype, window
                )
            else:
                spec = FullAttentionSpec(block_size, kv_heads, head_size, dtype)
            specs[f"layers.{layer_idx}"] = spec
        return specs

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: PagedAttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        step = DecoderStep(
            attn_metadata,
            kv_caches,
            self._cache_index,
            self._declared_windows,
            self.attention_backend,
        )
        out = self.hf_model.base_model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,  # the KV cache is ours
            **{STEP_KWARG: step},
        )
        _check_attention_calls(step, len(self._layers), type(self.hf_model).__name__)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden] → float32 logits [num_seqs, vocab or num_labels]."""
        assert self._head is not None, "an embedding model has no head"
        return self._head(hidden).float()
