"""The fallback: a Hugging Face model run as it is, when neither a native model nor the
transformers backend (tidepool's attention plugged in) can run it.

    model_impl="auto"      native ──▶ transformers backend ──▶ this fallback (pooling tasks)
    model_impl="fallback"  this fallback, asked for by name

The model keeps its own attention and runs on padded batches: the runner sorts the step's prompts
longest first and the encoder metadata groups them into buckets of similar length
(attention/metadata.py); each bucket is one HF forward with an attention mask. A model whose
forward takes no attention mask (FNet mixes tokens with a Fourier transform) runs buckets of equal
length only, so padding never changes an output. Unpacked: slower than the two paths above,
equal to sentence-transformers (which runs the same code on the same padded batches).

model_impl="auto" also falls back when the backend passes its checks but its first forward raises
or disagrees with transformers' (fallback_if_backend_fails: the load-time check of
transformers_backend/check.py, at resolve time), with the same one warning line saying why.

Refused: remote code without trust_remote_code=True (resolve_hf_class), generation (the runner's
decoder path needs a KV cache the HF model does not share), and models whose outputs tidepool
cannot pool: those that return no per-token states [batch, tokens, hidden] (a downsampling
encoder such as FunnelBaseModel, a vision or audio model), found by an 8-token dry run at load.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from tidepool.attention import cpu_kernels
from tidepool.attention.backend import (
    BUCKETED_SDPA,
    PACKED_BUCKETS,
    AttentionSpec,
    EncoderAttentionBackend,
    EncoderStepMetadata,
)
from tidepool.attention.metadata import EncoderAttentionMetadata
from tidepool.config import ModelConfig
from tidepool.transformers_backend.backend import (
    _position_offset,
    _use_packed_linears,
    build_transformers_model,
    check_transformers_version,
    resolve_hf_class,
)
from tidepool.transformers_backend.wrappers import EOS_POOLED_ENCODERS, EosPooling, HeadRunner

logger = logging.getLogger("tidepool")


class UnpoolableModelError(ValueError):
    """A model whose outputs are not one hidden state per input token."""


@dataclass(frozen=True)
class FallbackInfo:
    """What the engine configuration needs before the model is built."""

    hf_class: type[nn.Module]
    position_offset: int
    """padding_idx + 1 for RoBERTa-like embeddings (the model numbers positions itself)."""


def inspect_fallback(
    architecture: str, task: str, hf_config: Any, path: Any, trust_remote_code: bool, reason: str
) -> FallbackInfo:
    """Resolve the HF class (on the meta device) and say, in one warning line, that it runs
    unpacked; `reason` is why the faster paths cannot run it."""
    if task == "generate":
        raise ValueError(
            f"{architecture} cannot generate in tidepool: {reason}; the fallback (the HF model "
            "as it is) runs pooling tasks only (embed, classify, score)"
        )
    check_transformers_version()
    hf_class = resolve_hf_class(architecture, task, hf_config, path, trust_remote_code)
    with torch.device("meta"):
        hf_model = hf_class(hf_config)
    logger.warning(
        "%s runs on the fallback, unpacked (its own attention on padded batches, slower): %s",
        architecture,
        reason,
    )
    return FallbackInfo(hf_class, _position_offset(hf_model.base_model))


class BackendDisagreementError(RuntimeError):
    """model_impl="transformers": the backend's load-time check found it computes something else
    than transformers does (transformers_backend/check.py)."""


def fallback_if_backend_fails(config: ModelConfig, strict: bool = False) -> ModelConfig:
    """The transformers backend chose for an encoder proves itself before the checkpoint is read
    (transformers_backend/check.py): its model, on seeded parameters, against transformers' own
    attention on two packed sequences; then, for a dtype other than float32, an 8-token forward
    in that dtype. Where it disagrees or raises, `config` moves to the fallback, with its one
    warning line saying why; `strict` (model_impl="transformers"): raises instead. Some models
    pass the backend's checks on the meta device and fail only with real tensors (an attention
    call with arguments tidepool's interface does not take, a shape it assumes); some run and
    compute something else (a mask the model passes at call time)."""
    from tidepool.transformers_backend.check import check_backend, dry_forward

    try:
        disagreement = check_backend(config)
        if disagreement is None and config.dtype != torch.float32:
            dry_forward(build_transformers_model(config, with_weights=False), config)
    except Exception as e:
        if strict:
            raise
        disagreement = (
            f"the transformers backend failed at its first forward ({type(e).__name__}: {e})"
        )
    if disagreement is None:
        return config
    if strict:
        raise BackendDisagreementError(
            f'{config.architecture}: {disagreement}. model_impl="auto" runs it on the fallback '
            "(transformers' own attention on padded batches)"
        )
    args = (config.hf_config, config.path, config.trust_remote_code, disagreement)
    inspect_fallback(config.architecture, config.task, *args)
    return dataclasses.replace(config, model_impl="fallback")


def build_fallback_model(config: ModelConfig) -> FallbackEncoderModel:
    """The HF model for `config`, loaded by transformers, wrapped with the encoder contract."""
    hf_class = resolve_hf_class(
        config.architecture, config.task, config.hf_config, config.path, config.trust_remote_code
    )
    hf_model = hf_class.from_pretrained(
        str(config.path), config=config.hf_config, dtype=config.dtype
    ).to(config.device)
    body = hf_model.base_model
    if config.task == "embed" and isinstance(getattr(body, "pooler", None), nn.Module):
        body.pooler = None  # feeds classifiers only
    hf_model.eval().requires_grad_(False)
    _use_packed_linears(hf_model)
    eos_pooled = config.task == "embed" and type(hf_model).__name__ in EOS_POOLED_ENCODERS
    model = (FallbackEosPooledEncoder if eos_pooled else FallbackEncoderModel)(hf_model, config)
    model.check_outputs()
    return model


class FallbackEncoderModel(nn.Module):
    """An EncoderModel (models/interfaces.py) over a HF model run on padded buckets."""

    is_causal: ClassVar[bool] = False
    """The runner's encoder path (each prompt whole, no KV cache), causal HF models included."""
    supports_first_token_only: ClassVar[bool] = False

    def __init__(self, hf_model: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.hf_model = hf_model
        params = inspect.signature(hf_model.base_model.forward).parameters
        self._takes_mask = "attention_mask" in params
        self._takes_token_type_ids = "token_type_ids" in params
        pad = getattr(hf_model.config, "pad_token_id", None)
        self._pad_id = 0 if pad is None else int(pad)
        causal = bool(
            getattr(hf_model.config, "is_decoder", False)
        ) or config.architecture.endswith("ForCausalLM")
        self.default_pooling_type = "LAST" if causal else "CLS"
        self._head = HeadRunner(hf_model, is_causal=causal) if config.task != "embed" else None
        self.attention_backend: EncoderAttentionBackend = BUCKETED_SDPA
        """The HF model's own attention runs; its builder's packed buckets are read."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        config = self.hf_model.config
        heads = getattr(config, "num_attention_heads", None)
        head_dim = config.hidden_size // heads if heads else config.hidden_size
        max_len = int(getattr(config, "max_position_embeddings", 0) or 0)
        return AttentionSpec(
            device,
            dtype,
            head_dim,
            max_len or cpu_kernels.MAX_SEQ_LEN,
            needs=frozenset({PACKED_BUCKETS}),  # one HF forward per bucket (forward)
        )

    def set_attention_backend(self, backend: EncoderAttentionBackend) -> None:
        self.attention_backend = backend

    @torch.inference_mode()
    def check_outputs(self) -> None:
        """An 8-token dry run: the body must return one state per token."""
        device = next(self.hf_model.parameters()).device
        ids = torch.arange(8, device=device)[None] + self._pad_id + 1
        name = type(self.hf_model).__name__
        try:
            states = self._body(ids, torch.ones_like(ids), torch.zeros_like(ids))
        except Exception as e:
            raise UnpoolableModelError(
                f"{name} does not run on token ids alone ({type(e).__name__}: {e}); tidepool "
                "pools text encoders' per-token states"
            ) from e
        hidden = getattr(self.hf_model.config, "hidden_size", None)
        if states.dim() != 3 or states.shape[:2] != ids.shape or states.shape[2] != hidden:
            raise UnpoolableModelError(
                f"{name} returns states of shape {tuple(states.shape)} for 8 tokens, not one "
                f"state per token ([1, 8, {hidden}]), so tidepool cannot pool them"
            )

    def _body(
        self, ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": ids}
        if self._takes_mask:
            kwargs["attention_mask"] = mask
        if self._takes_token_type_ids:
            kwargs["token_type_ids"] = token_type_ids
        out = self.hf_model.base_model(**kwargs)
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """→ [num_tokens, hidden] in packed order; the HF model numbers positions itself."""
        if first_token_only:
            raise ValueError("supports_first_token_only is False: every row is computed")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        out: torch.Tensor | None = None
        # The step's buckets over the packed tokens (PACKED_BUCKETS, the attention spec's need).
        buckets = cast(EncoderAttentionMetadata, attn_metadata).packed_buckets
        for start, lens, keys in self._batches(buckets):
            # ids / mask / types: [num_seqs, max_len], right-padded with the pad id.
            max_len, num_seqs = lens[0], len(lens)
            lens_t = torch.tensor(lens, device=input_ids.device)
            slot = torch.arange(max_len, device=input_ids.device)
            mask = slot[None, :] < lens_t[:, None]
            starts = torch.cumsum(lens_t, 0) - lens_t + start
            index = torch.where(mask, starts[:, None] + slot[None, :], starts[:, None])
            ids = input_ids[index].masked_fill(~mask, self._pad_id)
            types = token_type_ids[index].masked_fill(~mask, 0)
            # The attention mask marks keys: a sequence's first key_lens[i] tokens (metadata.py).
            attended = mask if keys is None else slot[None, :] < torch.tensor(keys)[:, None]
            states = self._body(ids, attended.long(), types)  # [num_seqs, max_len, hidden]
            if out is None:
                out = states.new_empty(input_ids.shape[0], states.shape[-1])
            end = start + sum(lens)
            out[start:end] = states.reshape(num_seqs * max_len, -1)[mask.reshape(-1)]
        assert out is not None
        return out

    def _batches(
        self, meta: EncoderAttentionMetadata
    ) -> list[tuple[int, list[int], list[int] | None]]:
        """(first flat token, lengths, key counts or None) per padded batch: the metadata's
        buckets of similar length, or runs of equal length for a model that takes no attention
        mask (and so cannot honour key counts)."""
        lens = meta.seq_lens
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        if self._takes_mask:
            first_seq = {start: i for i, start in enumerate(starts)}
            batches = []
            for b in meta.buckets:
                i = first_seq[b.start]
                keys = None if meta.key_lens is None else meta.key_lens[i : i + b.num_seqs]
                batches.append((b.start, lens[i : i + b.num_seqs], keys))
            return batches
        if meta.key_lens is not None:
            raise ValueError("a model without an attention mask cannot leave tokens unattended")
        batches, i = [], 0
        while i < len(lens):
            j = i
            while j < len(lens) and lens[j] == lens[i]:
                j += 1
            batches.append((starts[i], lens[i:j], None))
            i = j
        return batches

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [num_seqs, hidden] → [num_seqs, num_labels] through the HF classifier."""
        assert self._head is not None, "an embedding model has no head"
        return self._head(pooled)


class FallbackEosPooledEncoder(EosPooling, FallbackEncoderModel):
    """A CLIP text tower on the fallback: its own embedding (EOS token, projection) as on the
    backend (transformers_wrappers.EosPooling)."""

    def __init__(self, hf_model: nn.Module, config: ModelConfig) -> None:
        super().__init__(hf_model, config)
        self.default_pooling_type = "LAST"
        self._init_eos_pooling(hf_model)
