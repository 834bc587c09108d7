"""A whole tiny BERT in int8 on tidepool's VNNI GEMM (csrc/cpu_int8_vnni.cpp), once per build the
CPU can run (AVX-512 VNNI, AVX-VNNI: the TIDEPOOL_CPU_ISA cap chooses it at load), against the
same model on oneDNN's GEMM + the epilogue kernels (TIDEPOOL_INT8_GEMM=onednn) and float32."""

from __future__ import annotations

import pytest
import torch
from cpu_isa import build_fixture

from tidepool import LLM
from tidepool.quantization import int8_ops
from tidepool.quantization.int8_linear import Int8Linear, int8_gemm_available

pytestmark = pytest.mark.skipif(
    not int8_gemm_available() or int8_ops.load() is None or int8_ops.load_amx() is not None,
    reason="the VNNI GEMM runs where the int8 epilogue kernels build and the CPU has no AMX-INT8 "
    "(there the AMX GEMM runs: test_int8.py's AMX BERT)",
)
isa = build_fixture(int8_ops.VNNI_ISAS, int8_ops.load_vnni, "the VNNI int8 GEMM")
TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "Packed tokens need no padding at all!",
    "int8 keeps the vectors close to float32 when each token has its own scale.",
    "A longer text about rivers, bridges, engineers and the committee that argued for months.",
]


def _vectors(llm: LLM, texts: list[str]) -> torch.Tensor:
    outputs = llm.embed(texts, use_tqdm=False)
    return torch.stack([torch.as_tensor(o.outputs.embedding) for o in outputs])


@pytest.mark.parametrize("two_part", ["never", "always"])
def test_vnni_bert_matches_the_onednn_bert(isa, two_part, tmp_path, minilm_path, monkeypatch):
    """Hidden 48 (K % 4, N % 16 but not % 64: the narrower column blocks), FFN 96: every int8
    linear on the VNNI build (fused epilogues, FFN up's exclusive handoff, reused buffers) gives
    the vectors of oneDNN's path (the same integer sums; float32 rounding in another order can
    move a later layer's rounding by one step: cos 0.99999), within int8's distance of float32,
    and a text's vector does not depend on its batch."""
    from conftest import copy_bert_tokenizer
    from transformers import BertConfig, BertModel

    torch.manual_seed(5)
    sizes = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=96, max_position_embeddings=128)  # fmt: skip
    BertModel(BertConfig(vocab_size=30522, **sizes)).save_pretrained(str(tmp_path))
    copy_bert_tokenizer(minilm_path, tmp_path)
    monkeypatch.setenv("TIDEPOOL_INT8_TWO_PART", two_part)
    vnni_llm = LLM(str(tmp_path), quantization="int8")
    layers = [m for m in vnni_llm.engine.model_runner.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(f"kernels=vnni-{isa}" in repr(m) for m in layers)
    assert any(m.two_part for m in layers) == (two_part == "always")
    monkeypatch.setenv("TIDEPOOL_INT8_GEMM", "onednn")
    onednn_llm = LLM(str(tmp_path), quantization="int8")
    assert all("kernels=native" in repr(m) for m in onednn_llm.engine.model_runner.model.modules()
               if isinstance(m, Int8Linear))  # fmt: skip
    # ~2,600 tokens in one step: the row-group path; one text alone: the column split.
    texts = TEXTS * 40
    vnni, onednn = _vectors(vnni_llm, texts), _vectors(onednn_llm, texts)
    reference = _vectors(LLM(str(tmp_path)), texts)
    cos = torch.nn.functional.cosine_similarity
    assert cos(vnni, onednn).min() >= 0.99999
    assert cos(vnni, reference).min() >= 0.99
    assert torch.equal(_vectors(vnni_llm, TEXTS[3:4]), vnni[3:4])  # batch invariance
