"""What an attention backend is: the interfaces the registry (backend.py) selects from.

A backend is three things, chosen together once per model at load:
    supports(spec)          whether it runs a model with this AttentionSpec here
    metadata_builder(...)   its AttentionMetadataBuilder (common.py): the step's neutral
                            description → the metadata its kernels read, once per step
    the kernel calls        what the model's layers call with that metadata
and a decoder backend owns its KV-cache layout (kv_cache_shape): the runner allocates the bytes
(paged.allocate_kv_caches), the backend says what shape each layer's view has.

The metadata a model reads besides handing it to the backend: an encoder model its `rows`
(common.LayerRows: where the layers hold the tokens, packed or the builder's padded slots) and
`seq_lens` (EncoderStepMetadata); a decoder model `output_rows`, `for_layer(i)` and
`for_output_rows(i)` (DecoderStepMetadata).

What more a model may ask of an encoder backend is named (capabilities): a model's
AttentionSpec lists what it `needs`, a backend what it `provides`; the registry picks the first
backend that supports the spec and provides its needs, and a model handed a backend without
them is refused at load, naming both (backend.check_provides):

    BANDED          attend_banded(q, k, v, meta, scale, window, causal): attention inside each
                    sequence within a band |q - k| < window and / or causal (EmbeddingGemma's
                    and ModernBERT's sliding-window layers, a causal text tower)
    PACKED_BUCKETS  meta.packed_buckets: the step's buckets of similar lengths over the packed
                    tokens (metadata.EncoderAttentionMetadata), for a model that pads its own
                    batches (the transformers fallback runs the HF model per bucket)
    PADDED_BUCKETS  meta itself is an EncoderAttentionMetadata whose buckets are plain
                    [num_seqs, max_len] slices of the layers' rows, for a model that attends
                    per bucket itself (DeBERTa's disentangled attention)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import torch

from tidepool import envs
from tidepool.attention.common import AttentionMetadataBuilder, LayerRows
from tidepool.attention.relative_bias import RelativePositionBias
from tidepool.kv_cache.spec import KVCacheSpec

BANDED = "banded"
PACKED_BUCKETS = "packed_buckets"
PADDED_BUCKETS = "padded_buckets"
CAPABILITIES = (BANDED, PACKED_BUCKETS, PADDED_BUCKETS)
"""What an encoder backend may provide beyond its kernel calls (the module docstring)."""


@dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention asks of a backend: the input of the selection."""

    device: torch.device
    """Where the model's weights (and so q, k, v) live."""
    dtype: torch.dtype
    """The model's compute dtype."""
    head_dim: int
    """Width of one attention head."""
    max_positions: int
    """The longest sequence the model can attend over (max_position_embeddings)."""
    matmul: str = "float32"
    """The precision the attention's two products may take (cpu_kernels.MATMULS): "float32"
    (exact), or "bf16" / "bf16x3" where the model allows reduced precision."""
    needs: frozenset[str] = frozenset()
    """The capabilities (CAPABILITIES) the model's layers use beyond the kernel calls."""

    def __post_init__(self) -> None:
        unknown = sorted(self.needs - set(CAPABILITIES))
        if unknown:
            raise ValueError(f"unknown attention capabilities {unknown}; known: {CAPABILITIES}")


REDUCED_MATMUL = {torch.bfloat16: "bf16", torch.float32: "bf16"}
"""The products of a model that allows reduced precision, by its dtype (float32: the int8
mode's activations). Measured in docs/performance.md ("AMX-bf16 products in the attention
kernel"): bf16 costs the int8 accuracy check nothing measurable and bf16x3 bought no speed."""


def reduced_precision_matmul(dtype: torch.dtype) -> str:
    """The attention products for a bfloat16 / int8 model: TIDEPOOL_CPU_ATTENTION_MATMUL unless
    "auto", else REDUCED_MATMUL."""
    chosen = envs.cpu_attention_matmul()
    return REDUCED_MATMUL.get(dtype, "float32") if chosen == "auto" else chosen


def with_reduced_precision(spec: AttentionSpec) -> AttentionSpec:
    """`spec` for a model that allows reduced-precision attention products."""
    return replace(spec, matmul=reduced_precision_matmul(spec.dtype))


# ----------------------------------------------------------------------------- encoders


class EncoderStepMetadata(Protocol):
    """What an encoder model reads of its backend's step metadata (the rest is the backend's)."""

    @property
    def seq_lens(self) -> list[int]:
        """Tokens per sequence, in flat order."""
        ...

    @property
    def rows(self) -> LayerRows:
        """Where the layers hold the tokens (the model gathers its inputs into them once)."""
        ...


class EncoderAttentionBackend(ABC):
    """Bidirectional attention inside each packed sequence of a step. Stateless: one instance
    serves every layer and every model. Every token of a sequence is a query; its keys are all
    its tokens, or its first key_lens[i] when the step has key counts (common.py). `meta` of the
    kernel calls is what this backend's metadata_builder built for the step: q, k, v and the
    outputs are on its `rows`."""

    name: ClassVar[str]
    provides: ClassVar[frozenset[str]] = frozenset()
    """The capabilities (CAPABILITIES) this backend's metadata and calls offer."""

    @classmethod
    @abstractmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        """Whether this backend runs a model with `spec` here (may build a kernel: call once)."""

    @abstractmethod
    def metadata_builder(self) -> AttentionMetadataBuilder[EncoderStepMetadata]:
        """The builder of this backend's step metadata (one per model, made at load)."""

    @abstractmethod
    def attend(
        self,
        qkv: torch.Tensor,
        meta: Any,
        scale: float,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        """qkv: [num_rows, 3, num_heads, head_dim] → [num_rows, num_heads * head_dim]; `bias`
        (relative_bias.py) is added to the scaled scores by key - query distance."""

    @abstractmethod
    def attend_first_tokens(
        self,
        qkv: torch.Tensor,
        meta: Any,
        scale: float,
        bias: RelativePositionBias | None = None,
    ) -> torch.Tensor:
        """Queries at each sequence's first row only → [num_seqs, num_heads * head_dim]."""

    @abstractmethod
    def attend_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: Any,
        scale: float,
    ) -> torch.Tensor:
        """q: [num_rows, heads, D], k / v: [num_rows, kv_heads, D] (strided views, kv_heads
        dividing heads) → [num_rows, heads * D]. The transformers backend's layers call this."""

    def attend_banded(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: Any,
        scale: float,
        window: int | None,
        causal: bool = False,
    ) -> torch.Tensor:
        """attend_heads within a band (BANDED): key k visible to query q when |q - k| < window;
        `causal`: keys k <= q only, and with a window 0 <= q - k < window."""
        raise NotImplementedError(f"attention backend {self.name!r} does not provide {BANDED!r}")

    def for_spec(self, spec: AttentionSpec) -> EncoderAttentionBackend:
        """The instance that runs `spec` (after `supports(spec)`): this one, unless the backend
        has one per option of the spec."""
        return self

    def __repr__(self) -> str:
        return f"<{self.name} attention>"


# ----------------------------------------------------------------------------- decoders


class DecoderStepMetadata(Protocol):
    """What a decoder model reads of its backend's step metadata (the rest is the backend's)."""

    num_tokens: int
    output_rows: torch.Tensor | None
    """[num_output_rows] int64: the flat tokens whose final hidden states the step reads, or
    None: every token (paged_metadata.PagedAttentionMetadata.output_rows)."""

    def for_layer(self, layer_index: int) -> Any:
        """What KV-cache layer `layer_index` hands its backend."""
        ...

    def for_output_rows(self, layer_index: int) -> Any:
        """The same for the last layer attended at the output rows only."""
        ...


class DecoderAttentionBackend(ABC):
    """Causal attention over the paged KV cache, in the layout this backend gives it."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        """Whether this backend runs a model with `spec` here."""

    @abstractmethod
    def metadata_builder(
        self, specs: Sequence[KVCacheSpec], device: torch.device
    ) -> AttentionMetadataBuilder[DecoderStepMetadata]:
        """The builder of this backend's step metadata for a model whose attention views have
        `specs` (one per view, in view order; made once the KV cache is allocated)."""

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """The shape of one layer's view of its KV-cache tensor (num_blocks blocks of `spec`):
        its elements are exactly num_blocks * spec.page_size_bytes bytes of spec.dtype."""

    @abstractmethod
    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key / value [T, Hkv, D] of this step's tokens → [T, Hq * D]; this
        step's K/V are written into `kv_cache` (a kv_cache_shape view) first."""

    def __repr__(self) -> str:
        return f"<{self.name} attention>"
