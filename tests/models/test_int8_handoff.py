"""int8 layers that hand their output on already quantized (quantization/chains.py): which pairs
link in a BERT layer, that the consumers then skip their quantizer, and that the result is the
same, bit for bit, as each layer quantizing its own input (the same kernel on the same rows)."""

from __future__ import annotations

import pytest
import torch

from tidepool import LLM
from tidepool.quantization import int8_ops
from tidepool.quantization.int8_linear import (
    Int8Linear,
    int8_gemm_available,
    onednn_int8_saturates,
)

pytestmark = pytest.mark.skipif(
    not int8_gemm_available() or int8_ops.load() is None or onednn_int8_saturates(),
    reason="the handoff is the int8 kernels' (oneDNN int8 linear, a kernel build, a C++ "
    "compiler); a CPU without VNNI runs int8 as split 7-bit GEMMs with torch epilogues, no "
    "handoff (quantization/int8_linear.py)",
)
TEXTS = ["hi", "The quick brown fox jumps over the lazy dog.", "Packed tokens, no padding."]


def _vectors(llm: LLM) -> torch.Tensor:
    return torch.stack([torch.as_tensor(o.outputs.embedding) for o in llm.embed(TEXTS)])


def test_links_skip_the_quantizer_and_change_nothing(tiny_model_path, monkeypatch) -> None:
    llm = LLM(str(tiny_model_path("bert")), quantization="int8")
    model = llm.engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    producers = [m for m in layers if m.__dict__.get("_consumer") is not None]
    num_layers = model.config.num_hidden_layers
    # Per layer: attention output → FFN up → FFN down → (the next layer's QKV).
    assert len(producers) == 3 * num_layers - 1
    calls = []
    real = int8_ops.quantize_rows
    monkeypatch.setattr(int8_ops, "quantize_rows", lambda *a: calls.append(1) or real(*a))
    linked = _vectors(llm)
    # Only the first QKV (the embeddings' rows) and each attention output (the attention's rows)
    # quantize their own inputs.
    assert len(calls) == 1 + num_layers
    for m in producers:
        m.__dict__["_consumer"] = None
    calls.clear()
    unlinked = _vectors(llm)
    assert len(calls) == len(layers)
    assert torch.equal(linked, unlinked)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_row_blocks_and_reused_buffers_change_nothing(kind: str, tiny_model_path) -> None:
    """With blocks of 8 rows every layer writes into its reused buffer (the tiny model's steps
    are far below the real block size): the vectors are the same bits as in one block, and a
    first call's token vectors survive a second call (the model's own output is never one of the
    reused buffers)."""
    llm = LLM(str(tiny_model_path(kind)), quantization="int8")
    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, Int8Linear)]
    assert sum("_scratch" in m.__dict__ for m in layers) == len(layers) - 1  # not the last
    whole = _vectors(llm)
    for m in layers:
        m._block_rows = 8
    tokens = llm.encode(TEXTS[1], pooling_task="token_embed")[0].outputs.data.clone()
    assert torch.equal(_vectors(llm), whole)
    kept = llm.encode(TEXTS[1], pooling_task="token_embed")[0].outputs.data
    llm.encode(TEXTS[2], pooling_task="token_embed")
    assert torch.equal(kept, tokens)
