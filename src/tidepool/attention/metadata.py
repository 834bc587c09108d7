"""Attention metadata for a flat, token-packed batch, built once per step and shared by all layers.

Bidirectional (encoder) attention over packed sequences is computed bucket by bucket: the runner
lays the sequences out longest first, and consecutive sequences of similar length form a bucket that
is attended to as one padded [num_seqs, max_len] batch. Worked example, lengths (7, 7, 6, 3):

    flat tokens   |a a a a a a a|b b b b b b b|c c c c c c|d d d|
    bucket 0      a, b, c  → padded to 7: c gets one masked slot (waste 1/21)
    bucket 1      d        → a single sequence: a plain slice, no padding, no mask

Padding stays below `max_pad_fraction` of a bucket, so the waste is bounded, and the number of
kernel calls per layer is the number of buckets, not the number of sequences (a per-sequence loop
pays framework overhead per call, more than the arithmetic for short texts: docs/performance.md, 'Choices in the encoder path').

A sequence may also have fewer keys than tokens (`key_lens`: a ColBERT query whose [MASK]
expansion attends to the text but is not attended to, as PyLate's attention mask of zeros on
those tokens): its keys are its first key_lens[i] tokens and every token is still a query. The
buckets carry that in their key masks, the CPU kernel takes the counts (key_lens_tensor).

Encoders then run on the *padded layout* (`pad_buckets`): the token ids are spread into the
buckets' [num_seqs, max_len] slots once per step, every layer works on the slots (a bucket is a
plain slice, attention needs no gather), and the final hidden states are gathered back to the
packed order once. Worked example above: 21 + 3 = 24 slots for 23 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tidepool.attention.common import AttentionMetadataBuilder, CommonAttentionMetadata, LayerRows

# A bucket's padded attention scores stay below this many elements (bounds memory).
_MAX_BUCKET_SCORE_ELEMS = 1 << 26


@dataclass(frozen=True)
class AttentionBucket:
    start: int
    """First flat token of the bucket (its sequences are contiguous in the flat batch)."""
    end: int
    num_seqs: int
    max_len: int
    gather_index: torch.Tensor | None
    """[num_seqs * max_len] flat token index per padded slot; None when no slot is padding."""
    key_mask: torch.Tensor | None
    """[num_seqs, 1, 1, max_len] bool, True where the slot is a key (a real token within its
    sequence's key count); None when every slot is."""
    valid_slots: torch.Tensor | None
    """[end - start] padded slots that hold real tokens, in flat order; None without padding."""
    key_bias: torch.Tensor | None = None
    """key_mask as an additive mask in the model's dtype (0 / -inf), when the step was built with
    a dtype: SDPA then skips converting the bool mask in every layer (7-10% faster attention)."""


@dataclass(frozen=True)
class EncoderAttentionMetadata:
    num_tokens: int
    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    """[num_seqs + 1] int64: sequence i is flat tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    buckets: list[AttentionBucket]
    rows: LayerRows
    """Where the layers hold the tokens: packed (build_encoder_metadata), or the padded
    buckets' slots (pad_buckets)."""
    seq_lens_tensor: torch.Tensor | None = None
    """[num_seqs] int64 seq_lens (on the device), for kernels that take the lengths."""
    key_lens: list[int] | None = None
    """Per sequence, how many of its first tokens are keys (<= its length); None: all tokens of
    every sequence (set only when some sequence has fewer keys than tokens)."""
    key_lens_tensor: torch.Tensor | None = None
    """[num_seqs] int64 key_lens (on the device), for kernels; None when key_lens is."""
    packed: EncoderAttentionMetadata | None = None
    """The padded layout's: the buckets over the packed tokens it was laid out from."""
    band_masks: dict[tuple[int, int, bool], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )
    """The step's band masks (torch_backend.encoder_attention_heads), made once per shape."""

    @property
    def packed_buckets(self) -> EncoderAttentionMetadata:
        """These buckets over the packed tokens (gathering their padded slots): what a model
        that pads its own batches reads (the transformers fallback)."""
        return self if self.packed is None else self.packed


def build_encoder_metadata(
    seq_lens: list[int],
    device: torch.device,
    max_pad_fraction: float = 0.15,
    num_heads: int = 12,
    dtype: torch.dtype | None = None,
    key_lens: list[int] | None = None,
) -> EncoderAttentionMetadata:
    """`seq_lens` in flat order, which the runner makes non-increasing (longest first);
    `key_lens`: per sequence, its number of keys (see the module docstring; None: all)."""
    if key_lens is not None and all(k == n for k, n in zip(key_lens, seq_lens, strict=True)):
        key_lens = None
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    buckets: list[AttentionBucket] = []
    i = 0
    while i < len(seq_lens):
        max_len = seq_lens[i]
        max_seqs = max(1, _MAX_BUCKET_SCORE_ELEMS // (num_heads * max_len * max_len))
        j = i + 1
        while (
            j < len(seq_lens)
            and j - i < max_seqs
            and seq_lens[j] <= max_len
            and seq_lens[j] >= max_len * (1.0 - max_pad_fraction)
        ):
            j += 1
        bucket_keys = None if key_lens is None else key_lens[i:j]
        buckets.append(
            _make_bucket(seq_lens[i:j], bucket_keys, cu[i], cu[j], max_len, device, dtype)
        )
        i = j
    cu_seqlens = torch.tensor(cu, dtype=torch.int64, device=device)
    return EncoderAttentionMetadata(
        num_tokens=cu[-1],
        seq_lens=list(seq_lens),
        cu_seqlens=cu_seqlens,
        buckets=buckets,
        rows=LayerRows.packed(cu_seqlens),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        key_lens=key_lens,
        key_lens_tensor=None
        if key_lens is None
        else torch.tensor(key_lens, dtype=torch.int64, device=device),
    )


def _make_bucket(
    lens: list[int],
    key_lens: list[int] | None,
    start: int,
    end: int,
    max_len: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> AttentionBucket:
    num_seqs = len(lens)
    padded = any(n != max_len for n in lens)
    fewer_keys = key_lens is not None and any(k != n for k, n in zip(key_lens, lens, strict=True))
    if not padded and not fewer_keys:
        return AttentionBucket(start, end, num_seqs, max_len, None, None, None)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    slot = torch.arange(max_len, dtype=torch.int64)
    valid = slot[None, :] < lens_t[:, None]  # [num_seqs, max_len]
    keys = valid  # [num_seqs, max_len]: the slots within their sequence's key count
    if fewer_keys:
        keys = slot[None, :] < torch.tensor(key_lens, dtype=torch.int64)[:, None]
    key_mask = keys.view(num_seqs, 1, 1, max_len)
    key_bias = None
    if dtype is not None:
        key_bias = torch.zeros(key_mask.shape, dtype=dtype).masked_fill_(~key_mask, float("-inf"))
        key_bias = key_bias.to(device)
    gather = valid_slots = None
    if padded:
        seq_starts = torch.cumsum(lens_t, 0) - lens_t + start
        # Padded slots read the sequence's first token: any real value works, the mask hides it.
        gather = torch.where(valid, seq_starts[:, None] + slot[None, :], seq_starts[:, None])
        gather = gather.reshape(-1).to(device)
        valid_slots = valid.reshape(-1).nonzero().squeeze(1).to(device)
    return AttentionBucket(
        start, end, num_seqs, max_len, gather, key_mask.to(device), valid_slots, key_bias
    )


@dataclass(frozen=True)
class PaddedLayout:
    """The step's tokens laid out bucket by bucket in padded form ([num_seqs, max_len] each).

    Gathering q/k/v into padded form and the attention output back cost two row gathers per layer
    (12-16% of MiniLM's time on the 2-core CPU); padding the token ids once costs the padding's
    rows of GEMM (under max_pad_fraction of a bucket, ~1% of a length-sorted corpus) and one
    gather of the final hidden states. Padding slots repeat a real token of their sequence and are
    masked as keys, so they change no real token's output.
    """

    token_index: torch.Tensor
    """[num_slots] the packed token each slot holds (padding slots repeat a real token)."""
    slot_of_token: torch.Tensor
    """[num_tokens] the slot each packed token went to (to gather the outputs back)."""
    metadata: EncoderAttentionMetadata
    """Buckets over the slots: plain slices with the original key masks, nothing to gather."""

    @property
    def is_packed(self) -> bool:
        """No bucket has padding: the slots are the packed tokens, in order (nothing to gather)."""
        return self.metadata.num_tokens == self.slot_of_token.shape[0]


def pad_buckets(meta: EncoderAttentionMetadata) -> PaddedLayout:
    token_index: list[torch.Tensor] = []
    slot_of_token: list[torch.Tensor] = []
    buckets: list[AttentionBucket] = []
    device = meta.cu_seqlens.device
    offset = 0
    for bucket in meta.buckets:
        num_slots = bucket.num_seqs * bucket.max_len
        if bucket.gather_index is None:
            token_index.append(torch.arange(bucket.start, bucket.end, device=device))
            slot_of_token.append(torch.arange(offset, offset + num_slots, device=device))
        else:
            assert bucket.valid_slots is not None
            token_index.append(bucket.gather_index)
            slot_of_token.append(bucket.valid_slots + offset)
        buckets.append(
            AttentionBucket(
                offset,
                offset + num_slots,
                bucket.num_seqs,
                bucket.max_len,
                None,
                bucket.key_mask,
                None,
                bucket.key_bias,
            )
        )
        offset += num_slots
    index, slot_of = torch.cat(token_index), torch.cat(slot_of_token)
    if offset == meta.num_tokens:  # no padding: the slots are the packed tokens, in order
        rows = LayerRows.packed(meta.cu_seqlens)
    else:
        shapes = tuple((b.start, b.end, b.max_len) for b in buckets)
        rows = LayerRows(index, slot_of, bucket_shapes=shapes)
    padded = replace(meta, num_tokens=offset, buckets=buckets, rows=rows, packed=meta)
    return PaddedLayout(index, slot_of, padded)


class PaddedBucketsBuilder(AttentionMetadataBuilder[EncoderAttentionMetadata]):
    """The bucketed SDPA backend's builder: the step's buckets (build_encoder_metadata) laid
    out as padded slots (pad_buckets), so that every layer attends plain slices; the layers'
    rows are those slots (`rows`), and `packed_buckets` keeps the buckets over the packed
    tokens."""

    def build(self, common: CommonAttentionMetadata) -> EncoderAttentionMetadata:
        return pad_buckets(build_buckets(common)).metadata


def build_buckets(common: CommonAttentionMetadata) -> EncoderAttentionMetadata:
    """The buckets of an encoder step over its packed tokens."""
    return build_encoder_metadata(
        common.seq_lens,
        common.device,
        num_heads=common.num_heads,
        dtype=common.dtype,
        key_lens=common.key_lens,
    )


PADDED_BUCKETS_BUILDER = PaddedBucketsBuilder()
