"""ColQwen2 (`ColQwen2ForRetrieval`) against transformers on the same tiny random weights.

Pages (an image with ColQwen2Processor's page prompt) and queries ("Query: ..." + 10 pad tokens
+ newline, as process_queries makes them) give one normalized vector per token, equal to
`ColQwen2ForRetrieval(...).embeddings` at the unpadded tokens (per-token cosine >= 0.9999 and
within the float32 bound); `LLM.score` of a query against image pages is MaxSim, equal to the
processor's `score_retrieval` within 1e-4 relative (and the float32 bound).

Depth 7 (2 vision blocks + patch linear + merger, 2 text layers, the projection) over 1176
terms (the patch linear's reduction, the longest).
"""

from __future__ import annotations

import pytest
import torch
from qwen2_vl_models import build_colqwen2, image_processor, make_images
from tolerances import assert_close, assert_cosine_close

from tidepool import LLM

DEPTH, REDUCTION = 7, 1176
IMAGES = make_images(3, seed=5)
QUERIES = ["what does the chart show?", "a red square", "Describe the image."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_colqwen2(tmp_path_factory.mktemp("colqwen2") / "model")


@pytest.fixture(scope="module")
def reference(folder):
    """(processor, page vectors, query vectors, query texts): transformers' unpadded rows."""
    from transformers import AutoTokenizer, ColQwen2ForRetrieval, ColQwen2Processor

    model = ColQwen2ForRetrieval.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    processor = ColQwen2Processor(image_processor=image_processor(), tokenizer=tokenizer)
    pages, queries = processor.process_images(IMAGES), processor.process_queries(QUERIES)
    with torch.no_grad():
        page_rows = model(**pages).embeddings
        query_rows = model(**queries).embeddings
    page_vectors = [e[m.bool()] for e, m in zip(page_rows, pages["attention_mask"], strict=True)]
    query_vectors = [
        e[m.bool()] for e, m in zip(query_rows, queries["attention_mask"], strict=True)
    ]
    texts = [
        tokenizer.decode(ids[m.bool()])
        for ids, m in zip(queries["input_ids"], queries["attention_mask"], strict=True)
    ]
    return processor, page_vectors, query_vectors, texts


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), device="cpu", dtype="float32")


def _pages():
    return [{"prompt": "", "multi_modal_data": {"image": image}} for image in IMAGES]


def test_token_vectors_equal_transformers(llm, reference):
    _, page_vectors, query_vectors, texts = reference
    assert llm.llm_engine.config.model.pooling_tasks == ("token_embed",)
    pages = llm.encode(_pages(), pooling_task="token_embed", use_tqdm=False)
    queries = llm.encode(texts, pooling_task="token_embed", use_tqdm=False)
    for got, expected in zip(
        [o.outputs.data for o in pages + queries], page_vectors + query_vectors, strict=True
    ):
        assert got.shape == expected.shape
        worst = assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION)
        assert worst >= 0.9999
        assert_close(got, expected, depth=DEPTH, reduction=REDUCTION, dim=-1)


def test_score_is_maxsim_equal_to_score_retrieval(llm, reference):
    processor, page_vectors, query_vectors, texts = reference
    # batch_size=1: score_retrieval pads a batch's passages with zero vectors, which would
    # take part in its max; one passage per batch has no padding.
    expected = processor.score_retrieval(query_vectors, page_vectors, batch_size=1)
    for row, text in enumerate(texts):
        got = torch.tensor([o.outputs.score for o in llm.score(text, _pages(), use_tqdm=False)])
        assert torch.allclose(got, expected[row], rtol=1e-4, atol=0)
        assert_close(got, expected[row], depth=DEPTH, reduction=REDUCTION * 32)
    # Guard: the pages' scores are far apart (1e-4 relative could not hide a swapped page).
    spread = expected.max(1).values - expected.min(1).values
    assert (spread / expected.abs().max(1).values).min() > 0.01


def test_page_prompt_must_hold_one_image_pad(llm):
    from tidepool.outputs import BatchInputError

    with pytest.raises(BatchInputError, match=r"has 0 <\|image_pad\|> for 1 image"):
        llm.encode(
            [{"prompt": "no placeholder here", "multi_modal_data": {"image": IMAGES[0]}}],
            pooling_task="token_embed",
            use_tqdm=False,
        )
