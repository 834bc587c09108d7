"""Real embedding clients pointed at the server (all-MiniLM-L6-v2 on uvicorn in this process):
langchain-openai's `OpenAIEmbeddings` and LlamaIndex's `OpenAIEmbedding` get the vectors the
offline `LLM.embed` computes.

Both libraries were written for OpenAI's models; the settings below are the ones a user sets for
an OpenAI-compatible server:
- langchain: `check_embedding_ctx_length=False` sends the texts as they are (by default it
  tokenizes them with tiktoken first, which downloads an encoding file: impossible offline, and
  tiktoken's token ids would mean nothing to this model anyway).
- LlamaIndex: `model_name` is any served name (it is passed through as `model`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from serverlib import ThreadedServer, start_threaded_server

from tidepool import LLM
from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.openai.server import ServerArgs, build_app

SERVED_NAME = "minilm"
TEXTS = [
    "What lives in a tide pool?",
    "Crabs, anemones and sea stars.",
    "An inference engine for pooling models.",
]
QUERY = "tide pool creatures"


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    engine = AsyncEngine.from_args()
    srv = start_threaded_server(build_app(engine, ServerArgs(served_model_name=[SERVED_NAME])))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(minilm_llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    documents = minilm_llm.embed(TEXTS, use_tqdm=False)
    query = minilm_llm.embed([QUERY], use_tqdm=False)[0]
    return (
        torch.tensor([o.outputs.embedding for o in documents]),
        torch.tensor(query.outputs.embedding),
    )


def _assert_same(got: list[list[float]] | list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)


def test_langchain_openai_embeddings(server: ThreadedServer, expected) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=SERVED_NAME,
        base_url=f"{server.url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents, query = expected
    _assert_same(embeddings.embed_documents(TEXTS), documents)
    _assert_same(embeddings.embed_query(QUERY), query)


def test_llama_index_openai_embedding(server: ThreadedServer, expected) -> None:
    llama_openai = pytest.importorskip("llama_index.embeddings.openai")
    embedding = llama_openai.OpenAIEmbedding(
        model_name=SERVED_NAME, api_base=f"{server.url}/v1", api_key="unused", max_retries=0
    )
    documents, query = expected
    _assert_same(embedding.get_text_embedding_batch(TEXTS), documents)
    _assert_same(embedding.get_query_embedding(QUERY), query)
