"""Instruction prompts (engine/prompts.py): prompt_name per call and per request, as
sentence-transformers applies them (the prompt text put before the input, then tokenized), the
default_prompt_name, Cohere's input_type mapping, and the errors for unknown names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

PROMPTS = {"query": "query: ", "passage": "passage: ", "Clustering": "Identify the topic: "}
TEXTS = ["What is a tide pool?", "Paris is the capital of France.", "hi"]


@pytest.fixture(scope="module")
def prompted_minilm(tmp_path_factory, minilm_path: Path) -> Path:
    """A copy of all-MiniLM-L6-v2 with prompts in its config_sentence_transformers.json."""
    folder = tmp_path_factory.mktemp("prompted") / "minilm"
    shutil.copytree(minilm_path, folder)
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.update(prompts=PROMPTS, default_prompt_name=None)
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def prompted_llm(prompted_minilm: Path):
    from tidepool import LLM

    return LLM(str(prompted_minilm))


@pytest.fixture(scope="module")
def prompted_st(prompted_minilm: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(prompted_minilm), device="cpu")


@pytest.mark.parametrize("prompt_name", ["query", "passage", "Clustering", None])
def test_embed_prompt_name_matches_sentence_transformers(prompted_llm, prompted_st, prompt_name):
    outputs = prompted_llm.embed(TEXTS, prompt_name=prompt_name, use_tqdm=False)
    actual = np.asarray([o.outputs.embedding for o in outputs])
    expected = prompted_st.encode(TEXTS, prompt_name=prompt_name, normalize_embeddings=True)
    cos = (actual * expected).sum(axis=1)
    assert cos.min() >= 0.99999, cos
    tokenizer = prompted_llm.get_tokenizer()
    prefix = PROMPTS.get(prompt_name, "") if prompt_name else ""
    assert outputs[0].prompt_token_ids == tokenizer(prefix + TEXTS[0])["input_ids"]


def test_prompts_change_the_embedding(prompted_llm):
    plain, query = (
        prompted_llm.embed(TEXTS[0], prompt_name=name, use_tqdm=False)[0].outputs.embedding
        for name in (None, "query")
    )
    assert not np.allclose(plain, query)


def test_encode_takes_prompt_name_and_token_ids_get_none(prompted_llm):
    [text] = prompted_llm.encode(TEXTS[0], prompt_name="query", use_tqdm=False)
    [embedded] = prompted_llm.embed(TEXTS[0], prompt_name="query", use_tqdm=False)
    assert text.prompt_token_ids == embedded.prompt_token_ids
    ids = [101, 7592, 102]
    [raw] = prompted_llm.encode({"prompt_token_ids": ids}, prompt_name="query", use_tqdm=False)
    assert raw.prompt_token_ids == ids


def test_default_prompt_name(tmp_path, prompted_minilm: Path, prompted_llm):
    from tidepool import LLM

    folder = tmp_path / "default"
    shutil.copytree(prompted_minilm, folder)
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config["default_prompt_name"] = "query"
    config_file.write_text(json.dumps(config))
    llm = LLM(str(folder))
    [by_default] = llm.embed(TEXTS[0], use_tqdm=False)
    [named] = prompted_llm.embed(TEXTS[0], prompt_name="query", use_tqdm=False)
    assert by_default.prompt_token_ids == named.prompt_token_ids


def test_unknown_prompt_name(prompted_llm, minilm_llm):
    with pytest.raises(ValueError, match=r"unknown prompt_name 'doc'.*Clustering, passage, query"):
        prompted_llm.embed(TEXTS, prompt_name="doc", use_tqdm=False)
    with pytest.raises(ValueError, match="it has no prompts"):
        minilm_llm.embed(TEXTS, prompt_name="query", use_tqdm=False)


def test_cohere_input_type_mapping(prompted_llm, minilm_llm):
    from tidepool.engine.prompts import prompt_name_for_input_type

    config = prompted_llm.model_config
    assert prompt_name_for_input_type(config, "search_query") == "query"
    assert prompt_name_for_input_type(config, "search_document") == "passage"
    assert prompt_name_for_input_type(config, "clustering") == "Clustering"
    assert prompt_name_for_input_type(config, "classification") is None
    assert prompt_name_for_input_type(config, None) is None
    assert prompt_name_for_input_type(minilm_llm.model_config, "search_query") is None
    with pytest.raises(ValueError, match="unknown input_type 'image'"):
        prompt_name_for_input_type(config, "image")


def test_server_prompt_name(prompted_minilm: Path, prompted_llm):
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    [expected] = prompted_llm.embed(TEXTS[0], prompt_name="query", use_tqdm=False)
    engine = AsyncEngine.from_args(str(prompted_minilm), device="cpu", dtype="float32")
    with TestClient(build_app(engine)) as client:
        for path in ("/v1/embeddings", "/pooling"):
            answer = client.post(path, json={"input": [TEXTS[0]], "prompt_name": "query"})
            assert answer.status_code == 200, answer.text
            row = answer.json()["data"][0]
            got = np.asarray(row.get("embedding", row.get("data")))
            assert float(got @ np.asarray(expected.outputs.embedding)) >= 0.99999
        # Cohere's input_type goes through the same rule (search_query → the "query" prompt).
        answer = client.post("/v2/embed", json={"texts": [TEXTS[0]], "input_type": "search_query"})
        assert answer.status_code == 200, answer.text
        got = np.asarray(answer.json()["embeddings"]["float"][0])
        assert float(got @ np.asarray(expected.outputs.embedding)) >= 0.99999
        assert answer.json()["meta"]["billed_units"]["input_tokens"] == len(
            expected.prompt_token_ids
        )
        answer = client.post("/v1/embeddings", json={"input": "x", "prompt_name": "nope"})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "prompt_name" and "passage, query" in error["message"]


# ---------------------------------------------------------------------- LLM.score, /embed_sparse


def test_score_prompt_names_match_sentence_transformers(prompted_llm, prompted_st):
    """A bi-encoder embeds data_1 with prompt_name and data_2 with document_prompt_name, as
    sentence-transformers' encode(prompt_name=) of each side; cosine within 1e-5."""
    query, documents = TEXTS[0], TEXTS[1:]
    for names in (("query", "passage"), ("query", None), (None, "passage")):
        scores = prompted_llm.score(
            query, documents, prompt_name=names[0], document_prompt_name=names[1], use_tqdm=False
        )
        q = prompted_st.encode([query], prompt_name=names[0], normalize_embeddings=True)
        d = prompted_st.encode(documents, prompt_name=names[1], normalize_embeddings=True)
        expected = (q @ d.T)[0]
        got = [o.outputs.score for o in scores]
        assert np.abs(np.asarray(got) - expected).max() <= 1e-5, (names, got, expected)
    plain = [o.outputs.score for o in prompted_llm.score(query, documents, use_tqdm=False)]
    assert abs(plain[0] - got[0]) > 1e-4  # guard: the prompts change the scores
    with pytest.raises(ValueError, match="unknown prompt_name 'doc'"):
        prompted_llm.score(query, documents, document_prompt_name="doc", use_tqdm=False)


def test_score_prompt_name_on_a_cross_encoder_matches_cross_encoder_predict(
    tmp_path, tiny_model_path
):
    """A cross-encoder gets prompt_name's text before each data_1 text, as sentence-transformers'
    CrossEncoder.predict(prompt_name=) does."""
    from sentence_transformers import CrossEncoder

    from tidepool import LLM

    folder = tmp_path / "cross"
    shutil.copytree(tiny_model_path("bert-cross-encoder"), folder)
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.update(prompts=PROMPTS, default_prompt_name=None)
    config_file.write_text(json.dumps(config))
    llm = LLM(str(folder))
    query, documents = TEXTS[0], TEXTS[1:]
    got = [
        o.outputs.score for o in llm.score(query, documents, prompt_name="query", use_tqdm=False)
    ]
    by_hand = [o.outputs.score for o in llm.score("query: " + query, documents, use_tqdm=False)]
    assert got == pytest.approx(by_hand, abs=1e-6)
    plain = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-6
    cross = CrossEncoder(str(folder), device="cpu", prompts=PROMPTS)
    expected = cross.predict([(query, d) for d in documents], prompt_name="query")
    assert np.abs(np.asarray(got) - expected).max() <= 1e-5


def test_embed_sparse_prompt_name_offline_and_on_tei_route(tmp_path, minilm_path: Path):
    """/embed_sparse takes TEI's prompt_name like /embed; an unknown one is a 400."""
    from fastapi.testclient import TestClient
    from sparse_models import save_splade

    from tidepool import LLM
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    folder = save_splade(tmp_path / "splade", minilm_path, 150, "max")
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.update(prompts=PROMPTS, default_prompt_name=None)
    config_file.write_text(json.dumps(config))
    llm = LLM(str(folder))
    [named] = llm.embed_sparse(TEXTS[0], prompt_name="query", use_tqdm=False)
    [by_hand] = llm.embed_sparse("query: " + TEXTS[0], use_tqdm=False)
    [plain] = llm.embed_sparse(TEXTS[0], use_tqdm=False)
    assert named.outputs.as_dict() == by_hand.outputs.as_dict() != plain.outputs.as_dict()
    engine = AsyncEngine.from_args(str(folder), device="cpu", dtype="float32")
    with TestClient(build_app(engine)) as client:
        answer = client.post("/embed_sparse", json={"inputs": TEXTS[0], "prompt_name": "query"})
        assert answer.status_code == 200, answer.text
        got = {v["index"]: v["value"] for v in answer.json()[0]}
        assert got == pytest.approx(named.outputs.as_dict(), abs=1e-6)
        answer = client.post("/embed_sparse", json={"inputs": "x", "prompt_name": "nope"})
        assert answer.status_code == 400
        assert "passage, query" in answer.text
