"""Long inputs (PoolerConfig.enable_chunked_processing, engine/chunked.py): a text longer than
max_model_len runs as chunks with their own special tokens, whose embeddings are combined by a
token-weighted mean (then normalized); a long reranked document scores the max of its chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

MAX_LEN = 16
LONG = " ".join(f"word{i} tide pool" for i in range(40))
SHORT = "a short text"
QUERY = "what lives in a tide pool?"
CHUNKED = {"enable_chunked_processing": True}


@pytest.fixture(scope="module")
def mean_llms(tiny_model_path):
    from tidepool import LLM

    path = str(tiny_model_path("bert-mean"))
    return LLM(path, max_model_len=MAX_LEN), LLM(path, max_model_len=MAX_LEN, pooler_config=CHUNKED)


@pytest.fixture(scope="module")
def rerankers(tiny_model_path):
    from tidepool import LLM

    path = str(tiny_model_path("bert-cross-encoder"))
    return LLM(path, max_model_len=MAX_LEN * 2), LLM(
        path, max_model_len=MAX_LEN * 2, pooler_config=CHUNKED
    )


def test_chunk_boundaries_are_exact(mean_llms):
    from tidepool.engine.chunked import ChunkedInput
    from tidepool.params import PoolingParams

    _, llm = mean_llms
    tokenizer = llm.get_tokenizer()
    [item] = llm.input_processor.process([LONG], [PoolingParams(task="embed")])
    assert isinstance(item, ChunkedInput)
    text_ids = tokenizer(LONG, add_special_tokens=False)["input_ids"]
    pieces = []
    for request in item.requests:
        ids = request.prompt_token_ids
        assert len(ids) <= MAX_LEN
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        pieces.extend(ids[1:-1])
    assert pieces == text_ids  # no token lost, none repeated, in order
    assert [len(r.prompt_token_ids) for r in item.requests[:-1]] == [MAX_LEN] * (
        len(item.requests) - 1
    )


def test_short_input_unchanged_and_long_equals_chunks_by_hand(mean_llms):
    plain, chunked = mean_llms
    [a] = plain.embed(SHORT, use_tqdm=False)
    [b] = chunked.embed(SHORT, use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert torch.equal(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding))
    [long] = chunked.embed([LONG], use_tqdm=False)
    # By hand: each chunk as a token-id prompt, unnormalized; weighted mean; normalize.
    ids = long.prompt_token_ids
    chunks = [ids[i : i + MAX_LEN] for i in range(0, len(ids), MAX_LEN)]
    from tidepool.params import PoolingParams

    outs = plain.encode(
        [{"prompt_token_ids": c} for c in chunks],
        PoolingParams(normalize=False),
        pooling_task="embed",
        use_tqdm=False,
    )
    weights = torch.tensor([len(c) for c in chunks], dtype=torch.float32)
    stacked = torch.stack([o.outputs.data for o in outs])
    expected = (weights[:, None] * stacked).sum(0) / weights.sum()
    # This pipeline has no Normalize module: the combined mean is returned as is.
    got = torch.tensor(long.outputs.embedding)
    assert torch.allclose(got, expected, atol=1e-5)
    [normalized] = chunked.embed(
        [LONG], pooling_params=PoolingParams(normalize=True), use_tqdm=False
    )
    got = torch.tensor(normalized.outputs.embedding)
    assert float(F.cosine_similarity(got, expected, dim=0)) >= 0.99999
    assert abs(float(got.norm()) - 1.0) < 1e-5


def test_without_the_option_the_error_stays(mean_llms):
    from tidepool.outputs import BatchInputError

    plain, _ = mean_llms
    with pytest.raises(BatchInputError, match="max_model_len"):
        plain.embed([LONG], use_tqdm=False)


def test_max_embed_len_refuses_one_input_and_serves_the_rest(tiny_model_path):
    from tidepool import LLM
    from tidepool.outputs import BatchInputError

    llm = LLM(
        str(tiny_model_path("bert-mean")),
        max_model_len=MAX_LEN,
        pooler_config={"enable_chunked_processing": True, "max_embed_len": 40},
    )
    with pytest.raises(BatchInputError) as info:
        llm.embed([SHORT, LONG, " ".join(LONG.split()[:20])], use_tqdm=False)
    assert [e.index for e in info.value.errors] == [1]
    assert "max_embed_len=40" in info.value.errors[0].message
    assert info.value.outputs[0] is not None and info.value.outputs[2] is not None


def test_long_document_rerank_scores_the_max_chunk(rerankers):
    from tidepool.engine.chunked import ChunkedInput
    from tidepool.params import PoolingParams

    plain, chunked = rerankers
    [short_plain] = plain.score(QUERY, SHORT, use_tqdm=False)
    [short_chunked] = chunked.score(QUERY, SHORT, use_tqdm=False)
    assert short_plain.outputs.score == short_chunked.outputs.score
    [long] = chunked.score(QUERY, LONG, use_tqdm=False)
    # By hand: the same chunk requests (query + a piece of the document) run one by one.
    [item] = chunked.input_processor.process_pairs([(QUERY, LONG)], [PoolingParams(task="score")])
    assert isinstance(item, ChunkedInput) and len(item.requests) > 2
    tokenizer = chunked.get_tokenizer()
    query_ids = tokenizer(QUERY, add_special_tokens=False)["input_ids"]
    pieces = []
    for request in item.requests:
        ids = request.prompt_token_ids
        assert len(ids) <= MAX_LEN * 2
        assert ids[1 : 1 + len(query_ids)] == query_ids
        pieces.extend(ids[2 + len(query_ids) : -1])
    assert pieces == tokenizer(LONG, add_special_tokens=False)["input_ids"]
    outputs, _ = plain.llm_engine.run_batch(item.requests)
    chunk_scores = [float(o.outputs.data.reshape(-1)[0]) for o in outputs]
    assert len(set(chunk_scores)) > 1  # guard: the chunks differ
    assert abs(long.outputs.score - max(chunk_scores)) < 1e-6


def test_pooler_config_checks():
    from tidepool.config import PoolerConfig

    with pytest.raises(ValueError, match="chunk_score_aggregation"):
        PoolerConfig(chunk_score_aggregation="median")
    with pytest.raises(ValueError, match="max_embed_len"):
        PoolerConfig(max_embed_len=0)


def test_combine_scores_modes():
    from tidepool.engine.chunked import combine_scores, split_tokens

    scores = [torch.tensor(0.2), torch.tensor(0.9), torch.tensor(0.4)]
    assert float(combine_scores(scores, "max")) == pytest.approx(0.9)
    assert float(combine_scores(scores, "mean")) == pytest.approx(0.5)
    assert float(combine_scores(scores, "first")) == pytest.approx(0.2)
    assert split_tokens(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_server_flag_and_routes(tiny_model_path, mean_llms, rerankers):
    """`--pooler-config` reaches the engine; /v1/embeddings and /rerank take long inputs as the
    offline LLM does."""
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.cli import build_parser
    from tidepool.entrypoints.cli_args import _engine_kwargs
    from tidepool.entrypoints.openai.server import build_app

    args = build_parser().parse_args(
        ["serve", "m", "--pooler-config", '{"enable_chunked_processing": true}']
    )
    assert _engine_kwargs(args)["pooler_config"] == CHUNKED
    _, offline = mean_llms
    [expected] = offline.embed([LONG], use_tqdm=False)
    engine = AsyncEngine.from_args(
        str(tiny_model_path("bert-mean")), max_model_len=MAX_LEN, pooler_config=CHUNKED
    )
    with TestClient(build_app(engine)) as client:
        answer = client.post("/v1/embeddings", json={"input": [SHORT, LONG]})
        assert answer.status_code == 200, answer.text
        got = torch.tensor(answer.json()["data"][1]["embedding"])
        assert torch.allclose(got, torch.tensor(expected.outputs.embedding), atol=1e-5)
    _, offline_reranker = rerankers
    scores = [o.outputs.score for o in offline_reranker.score(QUERY, [SHORT, LONG], use_tqdm=False)]
    engine = AsyncEngine.from_args(
        str(tiny_model_path("bert-cross-encoder")),
        max_model_len=MAX_LEN * 2,
        pooler_config=CHUNKED,
    )
    with TestClient(build_app(engine)) as client:
        answer = client.post("/rerank", json={"query": QUERY, "documents": [SHORT, LONG]})
        assert answer.status_code == 200, answer.text
        by_index = {r["index"]: r["relevance_score"] for r in answer.json()["results"]}
        assert abs(by_index[1] - scores[1]) < 1e-6 and abs(by_index[0] - scores[0]) < 1e-6
