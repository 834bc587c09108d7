"""What the model runner and the output stage may call and read on a model: the written contract.

    EncoderModel   bidirectional, no KV cache: the runner packs each prompt whole
                   forward(input_ids, positions, the backend's step metadata, token_type_ids,
                           first_token_only) → hidden [num_tokens, hidden] or [num_seqs, hidden]
    DecoderModel   causal, over the paged KV cache the runner owns
                   kv_cache_specs(block_size, dtype); forward(input_ids, positions,
                           the backend's step metadata, kv_caches) → hidden [num_tokens, hidden]
    both           is_causal, default_pooling_type; attention_spec(device, dtype) and
                   set_attention_backend(backend): the loader picks the backend once
                   (attention/backend.py), the model calls it
    ClassifierHead compute_logits(pooled [num_seqs, hidden]) → [num_seqs, num_labels]
    EmbeddingPoolingHead pool_embeddings(hidden, cu_seqlens, input_ids) → [num_seqs, dim]: the
                   model's own pooled embedding (CLIP's text towers: the EOS token's state, then
                   text_projection), used when sentence-transformers metadata names no pooling
    MRopeModel     uses_mrope, mrope_positions(num_tokens, images): a decoder rotating three
                   position rows (Qwen2-VL); the runner feeds it [3, num_tokens] positions
    LanguageModelHead compute_logits(hidden [num_seqs, hidden]) → float32 [num_seqs, vocab]
    per-token heads, called by the pooler on one text's token states [num_tokens, hidden]:
      VocabLogitsHead      compute_vocab_logits → [num_tokens, vocab]     (SPLADE's MLM head)
      TokenWeightHead      compute_token_weights → [num_tokens]            (BGE-M3's sparse_linear)
      TokenVectorHead      compute_token_vectors → [num_tokens, dim]       (BGE-M3's colbert_linear)
      TokenClassifierHead  compute_token_logits → [num_tokens, num_labels] (*ForTokenClassification)
    multi-modal (multimodal/features.py: MultiModalFeature, one image with its placeholder range):
      MultiModalModel  embed_multimodal(features) → one [length, hidden] per item (the tower's
                   rows, packed: many images per call); embed_input_ids(ids) → [num_tokens,
                   hidden]; forward(..., inputs_embeds=) takes the step's merged embeddings
                   (worker/multimodal.py scatters the items' rows at their placeholders)
      DualTowerModel   pool_multimodal(features) → [num_items, embedding_size]: an image-only
                   request's embedding (CLIP / SigLIP: vision tower + projection / head); texts
                   run the EncoderModel forward and EmbeddingPoolingHead (the text tower)
    ExtraWeightFiles extra_weight_files: tensors kept in files beside the checkpoint (BGE-M3's
                   sparse_linear.pt, colbert_linear.pt)
    LoadableModel  load_weights(checkpoint tensors) → the parameter names filled (native models;
                   the transformers backend fills its HF model itself)

Native models (bert.py, llama.py, gemma.py) and the transformers-backend wrappers
(transformers_wrappers.py) declare every member; nothing is probed with getattr. The Protocols
are runtime-checkable (isinstance checks that the members exist) for the loader's and the tests'
checks; the runner reads the declared members directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch

from tidepool.attention.backend import (
    AttentionSpec,
    DecoderAttentionBackend,
    DecoderStepMetadata,
    EncoderAttentionBackend,
    EncoderStepMetadata,
    select_decoder_backend,
    select_encoder_backend,
    with_reduced_precision,
)
from tidepool.kv_cache.spec import KVCacheSpec
from tidepool.models.mrope import ImagePlacement, MRopePositions
from tidepool.multimodal.features import MultiModalFeature


@runtime_checkable
class EncoderModel(Protocol):
    """A bidirectional encoder body (with or without a classifier head)."""

    is_causal: ClassVar[bool]
    """False: no KV cache, each prompt runs whole in one step."""
    default_pooling_type: str
    """CLS, MEAN, LAST or MAX: the pooling when sentence-transformers metadata names none."""
    supports_first_token_only: bool
    """forward(..., first_token_only=True) is implemented (CLS pooling computes one row per
    sequence in the last layer); when False the runner never passes it."""
    attention_backend: EncoderAttentionBackend
    """The backend the layers call (set by the loader; bucketed SDPA when built by hand)."""

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """What this model's attention needs (head width, positions) on `device` / `dtype`."""
        ...

    def set_attention_backend(self, backend: EncoderAttentionBackend) -> None:
        """Use `backend` from now on (called once, at load)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        """input_ids / positions / token_type_ids: [num_tokens], sequences packed in the
        metadata's order (positions 0-based per sequence) → [num_tokens, hidden]; with
        `first_token_only`, [num_seqs, hidden]: each sequence's first token. The layers run on
        the metadata's `rows` (the model gathers its inputs into them and takes the states
        back: attention/common.LayerRows)."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: EncoderStepMetadata,
        token_type_ids: torch.Tensor | None = None,
        first_token_only: bool = False,
    ) -> torch.Tensor: ...


@runtime_checkable
class DecoderModel(Protocol):
    """A causal decoder body (with or without an LM or classifier head)."""

    is_causal: ClassVar[bool]
    """True: runs over the paged KV cache; prompts may be chunked across steps."""
    default_pooling_type: str
    """The pooling of an embedding decoder when no metadata names one (LAST)."""
    attention_backend: DecoderAttentionBackend
    """The backend the layers call (set by the loader; paged SDPA when built by hand): its
    builder makes the step's metadata, its kv_cache_shape the cache views' shape."""

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec | None]:
        """Layer name → what it stores per block, in layer order: kv_caches[i] of `forward` is
        the i-th layer with a spec (None: a layer without a KV cache)."""
        ...

    def attention_spec(self, device: torch.device, dtype: torch.dtype) -> AttentionSpec:
        """What this model's attention needs on `device` / `dtype`."""
        ...

    def set_attention_backend(self, backend: DecoderAttentionBackend) -> None:
        """Use `backend` from now on (called once, at load)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: DecoderStepMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids / positions: [num_tokens] of the step's scheduled tokens; kv_caches: one
        [2, num_kv_heads, num_blocks, block_size, head_size] view per cached layer
        → hidden [num_tokens, hidden] (after the final norm), or [len(output_rows), hidden]
        where `attn_metadata.output_rows` names the only rows the step reads (a model may
        compute its last layer at those rows only; the runner selects them otherwise)."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: DecoderStepMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor: ...


@runtime_checkable
class MRopeModel(Protocol):
    """A decoder whose rotary takes three position rows (M-RoPE, models/mrope.py: Qwen2-VL)."""

    uses_mrope: bool
    """True: the runner feeds forward [3, num_tokens] positions from mrope_positions."""

    def mrope_positions(
        self, num_tokens: int, images: Sequence[ImagePlacement]
    ) -> MRopePositions | None:
        """A prompt of `num_tokens` tokens with its images' placeholders at `images` → its
        positions (computed once per request); None when uses_mrope is False."""
        ...


@runtime_checkable
class ClassifierHead(Protocol):
    """A sequence classifier / cross-encoder: the pooler calls it on the pooled states."""

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [num_seqs, hidden] → logits [num_seqs, num_labels]."""
        ...


@runtime_checkable
class EmbeddingPoolingHead(Protocol):
    """An encoder whose embedding is its own pooling of its token states (and a projection)."""

    embedding_size: int
    """The pooled embedding's width (CLIP: projection_dim for the *WithProjection tower)."""
    own_pooling_name: str
    """What the pooling is, for messages (e.g. "EOS")."""

    def pool_embeddings(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [num_tokens, hidden] of packed sequences (cu_seqlens), their token ids
        [num_tokens] → embeddings [num_seqs, embedding_size] (not normalized)."""
        ...


@runtime_checkable
class LanguageModelHead(Protocol):
    """A causal LM: the runner calls it on each finishing row's last hidden state."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden] → float32 logits [num_seqs, vocab]."""
        ...


@runtime_checkable
class VocabLogitsHead(Protocol):
    """A masked-LM head over the vocabulary (SPLADE pools its logits into sparse embeddings)."""

    def compute_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → logits [num_tokens, vocab] (decoder bias included)."""
        ...


@runtime_checkable
class TokenWeightHead(Protocol):
    """One non-negative weight per token (BGE-M3's lexical weights: relu(w · h + b))."""

    def compute_token_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → weights [num_tokens], >= 0."""
        ...


@runtime_checkable
class TokenVectorHead(Protocol):
    """One vector per token (BGE-M3's ColBERT projection), not normalized."""

    def compute_token_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → vectors [num_tokens, dim]."""
        ...


@runtime_checkable
class TokenClassifierHead(Protocol):
    """A per-token classifier (*ForTokenClassification)."""

    def compute_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → logits [num_tokens, num_labels]."""
        ...


@runtime_checkable
class MultiModalModel(Protocol):
    """A model whose prompts hold images among their tokens (Qwen2-VL, ColQwen2, ColPali): the
    runner (worker/multimodal.py) encodes each image once, when a step first schedules one of
    its placeholders, caches the rows until the request has computed them all (a chunked
    prompt encodes each image once), and hands forward the step's input embeddings with the
    images' rows at their placeholders. Its `forward` (the EncoderModel or DecoderModel one)
    takes `inputs_embeds` [num_tokens, hidden] as a keyword: given, it replaces the lookup of
    `input_ids` (which the model may still read, e.g. for per-token rules)."""

    supported_modalities: ClassVar[tuple[str, ...]]
    """The modalities its features may have ("image",)."""

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """Items of one step, of any requests → one [feature.length, hidden] tensor per item,
        in order, in the model's dtype on its device (run packed: one tower call for all)."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] → [num_tokens, hidden]: the embeddings forward would look up."""
        ...


@runtime_checkable
class DualTowerModel(Protocol):
    """Two towers into one space (CLIP, SigLIP). A text request runs the EncoderModel forward
    (the text tower) and the model's own pooling (EmbeddingPoolingHead: EOS / last token, then
    the projection); an image-only request (prompt "" + one image: its prompt_token_ids are the
    placeholders, one per vision position) runs `pool_multimodal`. One step may hold both."""

    supported_modalities: ClassVar[tuple[str, ...]]
    image_embedding_size: int
    """The width `pool_multimodal` returns (equal to the text side's embedding_size)."""

    def pool_multimodal(self, features: Sequence[MultiModalFeature]) -> torch.Tensor:
        """One item per image request → [num_items, image_embedding_size] (the vision tower over
        all items packed, then its projection / head; not normalized)."""
        ...


@runtime_checkable
class ExtraWeightFiles(Protocol):
    """A model with tensors in files beside the checkpoint's own (the loader adds them)."""

    extra_weight_files: ClassVar[Mapping[str, str]]
    """File name in the model folder → the prefix its tensors' names get (a torch state dict,
    e.g. "sparse_linear.pt" → "sparse_linear.": its "weight" loads as "sparse_linear.weight")."""


@runtime_checkable
class LoadableModel(Protocol):
    """A native model, filled from checkpoint tensors after construction on the meta device."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """(checkpoint name, tensor) pairs → the names of the parameters filled."""
        ...


PoolingModel = EncoderModel | DecoderModel
"""What the pooler reads hidden states from."""


def attach_attention_backend(
    model: EncoderModel | DecoderModel,
    device: torch.device,
    dtype: torch.dtype,
    reduced_precision: bool | None = None,
) -> None:
    """The loader's half of the attention contract: select the backend once (device and dtype
    are final; a CPU kernel builds now, during load) and hand it to the model.
    `reduced_precision`: whether the attention's products may leave float32 (attention/backend.py:
    the int8 mode asks once its linears are int8); None: for a bfloat16 model."""
    spec = model.attention_spec(device, dtype)
    if reduced_precision or (reduced_precision is None and dtype == torch.bfloat16):
        spec = with_reduced_precision(spec)
    if model.is_causal:
        model.set_attention_backend(select_decoder_backend(spec))  # type: ignore[arg-type]
    else:
        chosen = select_encoder_backend(spec, type(model).__name__)
        model.set_attention_backend(chosen)  # type: ignore[arg-type]
