"""Property tests of the InputProcessor: any prompt gives a Request or a RequestError for that
prompt alone, never an exception, and its neighbours come out as they would alone.

Prompts: arbitrary Unicode (lone surrogates included), control characters, NUL, combining marks,
right-to-left text, added tokens written in the text, strings up to 1 MB, token-id lists (in and
out of the vocabulary, wrong types), dicts and other values.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_tokenizer import PIECES

from tidepool.engine.input_processor import InputProcessor
from tidepool.model_loader.resolve import build_model_config
from tidepool.outputs import RequestError
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request

VOCAB = 30522
ANY_TEXT = st.text(st.characters(), max_size=40)  # every code point, surrogates included
PIECE_TEXT = st.lists(st.sampled_from([*PIECES, "\ud800", "\udfff", "\ud83d"]), max_size=60).map(
    "".join
)
BIG_TEXT = st.sampled_from(["tide pool ", "\u3000", "e\u0301", "שלום ", "a"]).map(
    lambda piece: piece * (1_000_000 // len(piece))
)
TOKEN_IDS = st.lists(st.integers(-3, VOCAB + 3), max_size=300) | st.lists(
    st.sampled_from([1.5, "7", None, True, [1]]), min_size=1, max_size=3
)
TEXTS = ANY_TEXT | PIECE_TEXT | BIG_TEXT
PROMPTS = (
    TEXTS
    | st.builds(lambda t: {"prompt": t}, TEXTS | st.integers())
    | st.builds(lambda ids: {"prompt_token_ids": ids}, TOKEN_IDS)
    | st.sampled_from([None, 7, 2.5, b"bytes", [], {}, ["nested"]])
)
TRUNCATION = st.sampled_from([None, None, -1, 1, 2, 3, 17, 128, 129])
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@pytest.fixture(scope="module")
def bert(tiny_model_path) -> InputProcessor:
    return InputProcessor(build_model_config(str(tiny_model_path("bert")), device="cpu"))


@pytest.fixture(scope="module")
def cross(tiny_model_path) -> InputProcessor:
    path = tiny_model_path("bert-cross-encoder")
    return InputProcessor(build_model_config(str(path), device="cpu"))


@pytest.fixture(scope="module")
def decoder(tiny_decoder_path) -> InputProcessor:
    return InputProcessor(build_model_config(str(tiny_decoder_path("llama")), device="cpu"))


def _key(item) -> object:
    """What must not depend on the neighbours: the tokens or the error message."""
    if isinstance(item, RequestError):
        return ("error", item.message)
    assert isinstance(item, Request)
    return (item.prompt_token_ids, item.token_type_ids)


def _check_batch(items, num: int) -> None:
    assert len(items) == num
    for i, item in enumerate(items):
        if isinstance(item, RequestError):
            assert item.index == i and item.message
        else:
            assert isinstance(item, Request)  # which one: _key(alone) == _key(item) below
            assert 0 < item.num_prompt_tokens <= 128


@SETTINGS
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=5), data=st.data())
def test_any_prompt_fails_alone(bert, prompts, data):
    tpts = data.draw(st.lists(TRUNCATION, min_size=len(prompts), max_size=len(prompts)))
    params = [PoolingParams(task="embed", truncate_prompt_tokens=t) for t in tpts]
    items = bert.process(prompts, params)
    _check_batch(items, len(prompts))
    for prompt, param, item in zip(prompts, params, items, strict=True):
        [alone] = bert.process([prompt], [param])
        assert _key(alone) == _key(item)


@SETTINGS
@given(pairs=st.lists(st.tuples(TEXTS | st.none(), TEXTS), min_size=1, max_size=4), data=st.data())
def test_any_pair_fails_alone(cross, pairs, data):
    tpts = data.draw(st.lists(TRUNCATION, min_size=len(pairs), max_size=len(pairs)))
    params = [PoolingParams(task="score", truncate_prompt_tokens=t) for t in tpts]
    items = cross.process_pairs(pairs, params)
    _check_batch(items, len(pairs))
    for pair, param, item in zip(pairs, params, items, strict=True):
        [alone] = cross.process_pairs([pair], [param])
        assert _key(alone) == _key(item)


@SETTINGS
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=4), data=st.data())
def test_any_generate_prompt_fails_alone(decoder, prompts, data):
    keep = data.draw(st.lists(st.sampled_from([None, 1, 5, 200]), min_size=len(prompts)))
    params = [SamplingParams(max_tokens=1, truncate_prompt_tokens=k) for k in keep[: len(prompts)]]
    items = decoder.process_generate(prompts, params, (2,))
    assert len(items) == len(prompts)
    for prompt, param, item in zip(prompts, params, items, strict=True):
        assert isinstance(item, (Request, RequestError))
        [alone] = decoder.process_generate([prompt], [param], (2,))
        assert (
            alone.message == item.message
            if isinstance(item, RequestError)
            else alone.prompt_token_ids == item.prompt_token_ids
        )
