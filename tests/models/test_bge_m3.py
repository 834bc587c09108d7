"""BGE-M3 (dense + lexical weights + ColBERT from one forward pass) against FlagEmbedding's
BGEM3FlagModel on a tiny random XLM-R saved in FlagEmbedding's layout (sparse_linear.pt and
colbert_linear.pt beside the checkpoint)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SIZES, TINY_TEXTS
from sparse_models import save_bge_m3
from tolerances import approx, assert_close, assert_cosine_close

from tidepool import LLM, PoolingParams
from tidepool.outputs import BatchInputError, sparse_pairs

TEXTS = [t for t in TINY_TEXTS if t.strip()]
# Float32 bounds (tests/tolerances.py): the encoder's layers plus the head, whose longest reduction
# is at most max_position_embeddings; a score (sparse sum, dense dot, ColBERT MaxSim) is one more.
DEPTH = TINY_SIZES["num_hidden_layers"] + 1
REDUCTION = max(
    TINY_SIZES["hidden_size"],
    TINY_SIZES["intermediate_size"],
    TINY_SIZES["max_position_embeddings"],
)


def _unavailable(*args, **kwargs):
    raise RuntimeError("transformers.modeling_attn_mask_utils is stubbed in this test")


def _stub_attribute(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _unavailable


def _flag_model_cls():
    # FlagEmbedding's package __init__ imports a reranker module that needs
    # transformers.modeling_attn_mask_utils, which transformers 5 removed; BGEM3FlagModel never
    # uses it, so an empty stand-in lets the import through.
    name = "transformers.modeling_attn_mask_utils"
    if name not in sys.modules:
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.__getattr__ = _stub_attribute  # type: ignore[method-assign]
            sys.modules[name] = stub
    flag = pytest.importorskip("FlagEmbedding")
    return flag.BGEM3FlagModel


@pytest.fixture(scope="module")
def m3_path(tmp_path_factory) -> Path:
    return save_bge_m3(tmp_path_factory.mktemp("bge_m3"))


@pytest.fixture(scope="module")
def m3_llm(m3_path) -> LLM:
    return LLM(str(m3_path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def m3_reference(m3_path):
    model = _flag_model_cls()(str(m3_path), use_fp16=False, devices="cpu")
    return model.encode(
        TEXTS, return_dense=True, return_sparse=True, return_colbert_vecs=True, batch_size=4
    )


def test_resolves_as_bge_m3(m3_llm):
    config = m3_llm.model_config
    assert config.architecture == "BgeM3EmbeddingModel"
    assert config.pooling_tasks == ("embed", "embed_sparse", "token_embed", "token_classify")
    assert set(config.sparse.skip_token_ids) == {0, 1, 2, 3}  # <s> <pad> </s> <unk>


def test_dense_matches_flag_embedding(m3_llm, m3_reference, report_tolerance):
    ours = torch.stack([o.outputs.data for o in m3_llm.encode(TEXTS, use_tqdm=False)])
    expected = torch.from_numpy(m3_reference["dense_vecs"]).float()
    report_tolerance("bge-m3 dense vs FlagEmbedding", ours, expected)
    assert_cosine_close(ours, expected, depth=DEPTH, reduction=REDUCTION)


def test_lexical_weights_match_flag_embedding(m3_llm, m3_reference):
    outputs = m3_llm.embed_sparse(TEXTS, use_tqdm=False)
    for text, out, expected in zip(TEXTS, outputs, m3_reference["lexical_weights"], strict=True):
        ours = out.outputs.as_dict()
        assert sorted(ours) == sorted(int(k) for k in expected), text
        expected = {int(k): float(v) for k, v in expected.items()}
        assert ours == approx(expected, depth=DEPTH, reduction=REDUCTION), text
    # The guards: some tokens weigh, some not; texts differ (a constant output cannot pass).
    weighted = [o.outputs.as_dict() for o in outputs if o.outputs.indices]
    assert len(weighted) >= len(outputs) // 2
    assert any(len(o.outputs.indices) < len(set(o.prompt_token_ids)) - 2 for o in outputs)
    assert weighted[0] != weighted[1]


def test_colbert_vectors_match_flag_embedding(m3_llm, m3_reference, report_tolerance):
    outputs = m3_llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for out, expected in zip(outputs, m3_reference["colbert_vecs"], strict=True):
        expected = torch.from_numpy(expected).float()
        # FlagEmbedding keeps the vectors of every token after <s> (</s> included).
        assert out.outputs.data.shape == expected.shape
        report_tolerance("bge-m3 colbert vs FlagEmbedding", out.outputs.data, expected)
        assert_cosine_close(out.outputs.data, expected, depth=DEPTH, reduction=REDUCTION)


def test_token_classify_gives_vllm_per_token_weights(m3_llm, m3_reference):
    """vLLM's BGE-M3 token_classify: one weight per token, <s> and </s> dropped."""
    text = TEXTS[1]
    out = m3_llm.encode([text], pooling_task="token_classify", use_tqdm=False)[0]
    ids = out.prompt_token_ids[1:-1]
    assert out.outputs.data.shape == (len(ids), 1)
    merged: dict[int, float] = {}
    for token_id, weight in zip(ids, out.outputs.data[:, 0].tolist(), strict=True):
        if weight > 0 and token_id != 3:
            merged[token_id] = max(merged.get(token_id, 0.0), weight)
    assert merged == pytest.approx(m3_llm.embed_sparse([text], use_tqdm=False)[0].outputs.as_dict())


def test_tasks_mixed_in_one_batch_equal_each_alone(m3_llm):
    """Dense, sparse and multi-vector requests share one forward pass; each equals its own
    run, whatever the batch."""
    tasks = ["embed", "embed_sparse", "token_embed", "token_classify"]
    params = [PoolingParams(task=tasks[i % 4]) for i in range(len(TEXTS))]
    mixed = m3_llm.encode(TEXTS, params, pooling_task=None, use_tqdm=False)
    for i, (text, out) in enumerate(zip(TEXTS, mixed, strict=True)):
        alone = m3_llm.encode([text], pooling_task=tasks[i % 4], use_tqdm=False)[0]
        a, b = out.outputs.data, alone.outputs.data
        if a.is_sparse:
            assert sparse_pairs(a)[0] == sparse_pairs(b)[0]
            a, b = a.to_dense(), b.to_dense()
        assert_close(a, b, depth=DEPTH, reduction=REDUCTION, msg=f"{tasks[i % 4]} {text!r}")


def test_sparse_top_k_keeps_the_largest_weights(m3_llm):
    full = m3_llm.embed_sparse([TEXTS[6]], use_tqdm=False)[0].outputs
    top = m3_llm.embed_sparse([TEXTS[6]], max_active_dims=3, use_tqdm=False)[0].outputs
    largest = sorted(full.as_dict().items(), key=lambda kv: -kv[1])[:3]
    assert top.as_dict() == dict(largest)
    tokens = m3_llm.embed_sparse([TEXTS[6]], return_tokens=True, use_tqdm=False)[0].outputs.tokens
    assert tokens == m3_llm.get_tokenizer().convert_ids_to_tokens(full.indices)


def test_colbert_vectors_are_normalized(m3_llm):
    data = m3_llm.encode([TEXTS[2]], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    hidden = TINY_SIZES["hidden_size"]
    assert_close(data.norm(dim=-1), torch.ones(len(data)), depth=1, reduction=hidden)
    raw = PoolingParams(normalize=False)
    unnormalized = m3_llm.encode([TEXTS[2]], raw, pooling_task="token_embed", use_tqdm=False)
    renormalized = F.normalize(unnormalized[0].outputs.data, dim=-1)
    assert_close(renormalized, data, depth=1, reduction=hidden, dim=-1)


def test_sparse_task_on_a_dense_model_is_a_clear_error(tiny_llm):
    llm = tiny_llm("xlm-roberta")
    with pytest.raises(ValueError, match="embed_sparse\\(\\) needs a sparse embedding model"):
        llm.embed_sparse(["x"], use_tqdm=False)
    # Per prompt in encode: the others of the batch are served.
    params = [PoolingParams(task="embed"), PoolingParams(task="embed_sparse")]
    with pytest.raises(BatchInputError, match="task 'embed_sparse' is not supported") as e:
        llm.encode(["a", "b"], params, use_tqdm=False)
    assert e.value.outputs[0] is not None and e.value.outputs[1] is None


PAIRS = [(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3]), (TEXTS[1], TEXTS[1])]


@pytest.mark.parametrize("weights", [None, [0.4, 0.2, 0.4]])
def test_compute_score_matches_flag_embedding(m3_path, m3_llm, weights):
    """tidepool.bge_m3_compute_score vs BGEM3FlagModel.compute_score (batch_size=1: FlagEmbedding
    pads a batch's passages with zero vectors, which can win a query vector's MaxSim)."""
    from tidepool import bge_m3_compute_score

    flag = _flag_model_cls()(str(m3_path), use_fp16=False, devices="cpu")
    expected = flag.compute_score(PAIRS, batch_size=1, weights_for_different_modes=weights)
    got = bge_m3_compute_score(m3_llm, PAIRS, weights_for_different_modes=weights)
    assert set(got) == set(expected)
    assert len(set(got["colbert+sparse+dense"])) == len(PAIRS)  # guard: pairs differ
    # Each score is relative to its mode's magnitude (a sparse score reaches ~343, a dense ~1).
    bound = dict(depth=DEPTH + 1, reduction=REDUCTION)
    for mode, values in got.items():
        assert values == approx(expected[mode], **bound), mode
    one = bge_m3_compute_score(m3_llm, PAIRS[0], weights_for_different_modes=weights)
    for mode, values in got.items():
        assert one[mode] == approx(values[0], scale=max(map(abs, values)), **bound), mode


def test_compute_score_needs_a_bge_m3_model(tiny_llm):
    from tidepool import bge_m3_compute_score

    with pytest.raises(ValueError, match="needs a BGE-M3 model"):
        bge_m3_compute_score(tiny_llm("bert"), PAIRS)
