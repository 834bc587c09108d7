"""Packed-sequence attention and the fused linear layer, against plain torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool.attention import torch_backend
from tidepool.attention.metadata import build_encoder_metadata, pad_buckets
from tidepool.models.layers.linear import Linear


def _reference_attention(qkv: torch.Tensor, seq_lens: list[int], scale: float) -> torch.Tensor:
    """One SDPA call per sequence: slow, obviously right."""
    outs, start = [], 0
    for n in seq_lens:
        q, k, v = qkv[start : start + n].float().permute(1, 2, 0, 3)  # [3, H, n, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [H, n, D]
        outs.append(o.transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


def test_buckets_bound_padding_and_cover_every_token():
    seq_lens = [100, 98, 90, 86, 40, 39, 7, 3, 3, 1]
    meta = build_encoder_metadata(seq_lens, torch.device("cpu"), max_pad_fraction=0.15, num_heads=2)
    covered = []
    for b in meta.buckets:
        lens = seq_lens[len(covered) : len(covered) + b.num_seqs]
        covered += lens
        assert b.max_len == max(lens)
        assert min(lens) >= b.max_len * 0.85  # padding below 15% of every sequence
        assert b.end - b.start == sum(lens)
        assert (b.gather_index is None) == all(n == b.max_len for n in lens)
    assert covered == seq_lens
    # [100, 98, 90, 86] | [40, 39] | [7] | [3, 3] | [1]
    assert [b.num_seqs for b in meta.buckets] == [4, 2, 1, 2, 1]
    assert meta.cu_seqlens.tolist() == [0, 100, 198, 288, 374, 414, 453, 460, 463, 466, 467]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_encoder_attention_matches_per_sequence_sdpa(dtype, tol):
    torch.manual_seed(0)
    seq_lens = [57, 55, 50, 31, 30, 12, 12, 12, 5, 1]
    heads, head_dim = 4, 16
    qkv = torch.randn(sum(seq_lens), 3, heads, head_dim).to(dtype)
    meta = build_encoder_metadata(seq_lens, torch.device("cpu"), num_heads=heads)
    out = torch_backend.encoder_attention(qkv, meta, head_dim**-0.5)
    ref = _reference_attention(qkv, seq_lens, head_dim**-0.5)
    assert out.shape == (sum(seq_lens), heads * head_dim)
    assert (out.float() - ref).abs().max().item() < tol


def test_attention_never_crosses_sequences():
    """Changing one sequence's tokens must not change another's output."""
    torch.manual_seed(0)
    seq_lens = [20, 19, 18]
    qkv = torch.randn(sum(seq_lens), 3, 2, 8)
    meta = build_encoder_metadata(seq_lens, torch.device("cpu"), num_heads=2)
    base = torch_backend.encoder_attention(qkv, meta, 0.3)
    qkv2 = qkv.clone()
    qkv2[20:39] = torch.randn(19, 3, 2, 8)  # the second sequence only
    other = torch_backend.encoder_attention(qkv2, meta, 0.3)
    assert torch.equal(base[:20], other[:20]) and torch.equal(base[39:], other[39:])
    assert not torch.allclose(base[20:39], other[20:39])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_padded_layout_attention_matches_packed(dtype, tol):
    """The encoders' padded layout: ids spread into bucket slots, attention on plain slices,
    outputs gathered back — equal to per-sequence attention on the packed tokens."""
    torch.manual_seed(0)
    seq_lens = [57, 55, 50, 31, 30, 12, 12, 12, 5, 1]
    heads, head_dim = 4, 16
    qkv = torch.randn(sum(seq_lens), 3, heads, head_dim).to(dtype)
    # With a dtype the key masks are additive biases (the runner's path); without, bool masks.
    meta = build_encoder_metadata(seq_lens, torch.device("cpu"), num_heads=heads, dtype=dtype)
    assert all(
        b.key_bias is not None and b.key_bias.dtype == dtype
        for b in meta.buckets
        if b.key_mask is not None
    )
    layout = pad_buckets(meta)
    assert not layout.is_packed
    slots = layout.metadata.num_tokens
    # 57+55+50 → 3x57, 31+30 → 2x31, 12x3, 5, 1: the padding is only what the buckets add.
    assert slots == 3 * 57 + 2 * 31 + 3 * 12 + 5 + 1
    assert torch.equal(layout.token_index[layout.slot_of_token], torch.arange(sum(seq_lens)))
    assert all(b.gather_index is None for b in layout.metadata.buckets)
    out = torch_backend.encoder_attention(
        qkv[layout.token_index], layout.metadata, head_dim**-0.5
    ).index_select(0, layout.slot_of_token)
    ref = _reference_attention(qkv, seq_lens, head_dim**-0.5)
    assert (out.float() - ref).abs().max().item() < tol
    packed = pad_buckets(build_encoder_metadata([9, 9, 4], torch.device("cpu"), num_heads=heads))
    assert packed.is_packed  # no bucket pads: nothing to gather


# The residual is fused only into layers without an activation (as BERT uses them).
@pytest.mark.parametrize(
    "activation,use_residual",
    [(None, False), ("gelu", False), ("gelu_new", False), ("relu", False), (None, True)],
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fused_linear_matches_unfused(activation, use_residual, dtype, tol):
    torch.manual_seed(0)
    layer = Linear(48, 96 if not use_residual else 48, activation=activation)
    with torch.no_grad():
        layer.weight.normal_(0, 0.2)
        layer.bias.normal_(0, 0.2)
    layer = layer.to(dtype)
    x = torch.randn(37, 48, dtype=dtype)
    residual = torch.randn(37, layer.out_features, dtype=dtype) if use_residual else None
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    if activation == "gelu":
        expected = F.gelu(expected)
    elif activation == "gelu_new":
        expected = F.gelu(expected, approximate="tanh")
    elif activation == "relu":
        expected = F.relu(expected)
    if residual is not None:
        expected = expected + residual.float()
    layer.process_weights_after_loading()
    # The oneDNN path is what is tested on CPU where it runs this dtype (its bfloat16 kernels
    # need AVX-512 or AVX-NE-CONVERT: an AVX2-only CPU keeps F.linear for bfloat16).
    onednn_runs = torch.backends.mkldnn.is_available() and (
        dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert (layer._packed is not None) == onednn_runs
    got = layer(x, residual=residual)
    assert got.dtype == dtype
    assert (got.float() - expected).abs().max().item() < tol * max(1.0, expected.abs().max().item())
