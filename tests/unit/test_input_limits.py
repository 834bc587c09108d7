"""InputProcessor limits: Unicode the tokenizer cannot take, huge texts, truncation rules, threads.

Truncation reads only a prefix of a text (PrefixTokenizer); here the results are compared with
transformers' own truncation of the whole text, for the WordPiece, BPE and Unigram tiny models,
with and without a sentence-transformers prompt and lower-casing.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
from test_prefix_tokenizer import PIECES

from tidepool.engine import prefix_tokenizer
from tidepool.engine.input_processor import InputProcessor
from tidepool.engine.truncation import longest_first
from tidepool.model_loader.resolve import build_model_config
from tidepool.outputs import RequestError
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request

MAX_LEN = 128
SURROGATE_MESSAGE = (
    "has a lone surrogate U+D800 at character 4; text must be valid Unicode "
    "(surrogates U+D800..U+DFFF cannot be encoded as UTF-8)"
)


def _processor(path: Path) -> InputProcessor:
    return InputProcessor(build_model_config(str(path), device="cpu"))


@pytest.fixture(scope="module")
def processors(tiny_model_path, tmp_path_factory) -> dict[str, InputProcessor]:
    folder = tmp_path_factory.mktemp("st_prompted") / "bert"
    shutil.copytree(tiny_model_path("bert"), folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": True}))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "Query: "}, "default_prompt_name": "query"})
    )
    kinds = ("bert", "roberta", "xlm-roberta", "bert-cross-encoder")
    return {
        **{kind: _processor(tiny_model_path(kind)) for kind in kinds},
        "bert-prompted": _processor(folder),
    }


def _params(n: int, **kwargs) -> list[PoolingParams]:
    return [PoolingParams(task="embed", **kwargs) for _ in range(n)]


def _random_texts(seed: int, num: int, max_pieces: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PIECES, k=rng.randint(1, max_pieces))) for _ in range(num)]


def _reference(processor: InputProcessor, text: str, max_length: int | None) -> list[int]:
    prepared = processor._prepare_text(text)
    kwargs = {} if max_length is None else {"truncation": True, "max_length": max_length}
    return processor.tokenizer(prepared, **kwargs)["input_ids"]


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta", "bert-prompted"])
def test_truncation_equals_truncating_the_whole_text(processors, kind):
    processor = processors[kind]
    texts = _random_texts(seed=len(kind), num=24, max_pieces=400)
    # Tiny read sizes: most texts are read in part, some grown several times.
    with (
        mock.patch.object(prefix_tokenizer, "MIN_CHARS", 16),
        mock.patch.object(prefix_tokenizer, "FIRST_CHARS_PER_TOKEN", 2),
    ):
        num_sparse = 0
        for tpt in (3, 7, 64, -1):
            results = processor.process(texts, _params(len(texts), truncate_prompt_tokens=tpt))
            limit = processor.max_model_len if tpt == -1 else tpt
            for text, r in zip(texts, results, strict=True):
                if isinstance(r, RequestError):  # the read limit, shrunk to 64 characters here
                    assert "so a text this sparse" in r.message
                    num_sparse += 1
                    continue
                assert r.prompt_token_ids == _reference(processor, text, limit)
        assert num_sparse < 10


def test_without_truncation_short_texts_are_exact_and_long_ones_refused(processors):
    bert = processors["bert"]
    texts = _random_texts(seed=5, num=30, max_pieces=300)
    for text, r in zip(texts, bert.process(texts, _params(len(texts))), strict=True):
        full = _reference(bert, text, None)
        if len(full) <= MAX_LEN:
            assert r.prompt_token_ids == full
        elif len(text) <= 4096:  # read whole: the exact count
            assert r == RequestError(r.index, bert._check_len(len(full)))
        else:
            assert f"is longer than {MAX_LEN} tokens" in r.message


def test_pairs_truncate_like_longest_first(processors):
    cross = processors["bert-cross-encoder"]
    # Short texts keep transformers' reference fast (its overflow bookkeeping is quadratic in
    # pair length); tiny read sizes make PrefixTokenizer cut them anyway.
    pairs = list(
        zip(
            _random_texts(7, 24, 100),
            _random_texts(9, 24, 100)[8:] + _random_texts(3, 8, 3),
            strict=True,
        )
    )
    with (
        mock.patch.object(prefix_tokenizer, "MIN_CHARS", 16),
        mock.patch.object(prefix_tokenizer, "FIRST_CHARS_PER_TOKEN", 2),
    ):
        for tpt in (5, 8, 41, -1):
            limit = MAX_LEN if tpt == -1 else tpt
            results = cross.process_pairs(pairs, _params(len(pairs), truncate_prompt_tokens=tpt))
            for (a, b), r in zip(pairs, results, strict=True):
                n_a, n_b = (
                    len(cross.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (a, b)
                )
                ref = cross.tokenizer(a, b, truncation=True, max_length=limit)
                if n_a > n_b > limit - 3 and (limit - 3) % 2:
                    # The documented difference: the odd token goes to the second text.
                    assert len(r.prompt_token_ids) == len(ref["input_ids"])
                    continue
                assert r.prompt_token_ids == ref["input_ids"]
                assert r.token_type_ids == ref["token_type_ids"]


def test_longest_first_rule():
    assert longest_first(3, 4, 10) == (3, 4)
    assert longest_first(2, 20, 10) == (2, 8)
    assert longest_first(20, 2, 10) == (8, 2)
    assert longest_first(6, 7, 9) == (4, 5)
    assert longest_first(7, 6, 9) == (5, 4)  # the longer text gets the odd token
    assert longest_first(50, 40, 9) == (4, 5)  # both over the budget: the second gets it


def test_truncate_prompt_tokens_counts_special_tokens(processors):
    bert, cross = processors["bert"], processors["bert-cross-encoder"]
    text = "tide " * 300
    one, two, three = bert.process([text] * 3, [*_params(1, truncate_prompt_tokens=1),
                                                *_params(1, truncate_prompt_tokens=2),
                                                *_params(1, truncate_prompt_tokens=3)])  # fmt: skip
    message = (
        "truncate_prompt_tokens={} leaves no room for text: it counts the 2 special tokens the "
        "model adds to each prompt, and at least one token of the text must stay, so it must be "
        "at least 3 (or -1 for max_model_len)"
    )
    assert one == RequestError(0, message.format(1))
    assert two == RequestError(1, message.format(2))
    assert three.prompt_token_ids == [101, bert.tokenizer.convert_tokens_to_ids("tide"), 102]
    # Token-id prompts get no special tokens: 1 keeps one id.
    [ids] = bert.process(
        [{"prompt_token_ids": [101, 7592, 102]}], _params(1, truncate_prompt_tokens=1)
    )
    assert ids.prompt_token_ids == [101]
    # A pair needs a token of each text on top of its 3 special tokens.
    four, five = cross.process_pairs(
        [("query", text)] * 2,
        [*_params(1, truncate_prompt_tokens=4), *_params(1, truncate_prompt_tokens=5)],
    )
    assert isinstance(four, RequestError) and "so it must be at least 5" in four.message
    assert "3 special tokens the model adds to each pair" in four.message
    assert len(five.prompt_token_ids) == 5 and five.token_type_ids[-1] == 1
    # -1 is max_model_len.
    [full] = bert.process([text], _params(1, truncate_prompt_tokens=-1))
    assert len(full.prompt_token_ids) == MAX_LEN


def test_lone_surrogates_fail_that_prompt_alone(processors):
    bert, cross = processors["bert"], processors["bert-cross-encoder"]
    ok, bad, bad_dict, nul = bert.process(
        ["ok", "abc \ud800", {"prompt": "abc \ud800"}, "a\x00b"], _params(4)
    )
    assert ok.prompt_token_ids == bert.tokenizer("ok")["input_ids"]
    assert bad == RequestError(1, f"the prompt {SURROGATE_MESSAGE}")
    assert bad_dict == RequestError(2, f"the prompt {SURROGATE_MESSAGE}")
    assert nul.prompt_token_ids == bert.tokenizer("a\x00b")["input_ids"]  # NUL is dropped: "ab"
    good, both = cross.process_pairs([("q", "doc"), ("abc \ud800", "abc \ud800")], _params(2))
    assert isinstance(good, Request)
    assert both == RequestError(
        1, f"the first text of the pair {SURROGATE_MESSAGE}; the second text of the pair "
        f"{SURROGATE_MESSAGE}"
    )  # fmt: skip


@pytest.fixture(scope="module")
def decoder(tiny_decoder_path) -> InputProcessor:
    return _processor(tiny_decoder_path("llama"))


def test_generate_prompts(decoder):
    sampling = [
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=1, truncate_prompt_tokens=1),
    ]
    ok, bad = decoder.process_generate(["hello world", "abc \ud800"], sampling[:1] * 2, (2,))
    assert ok.prompt_token_ids == decoder.tokenizer("hello world")["input_ids"]
    assert bad == RequestError(1, f"the prompt {SURROGATE_MESSAGE}")
    [last] = decoder.process_generate(["hello world"], sampling[1:], (2,))
    assert last.prompt_token_ids == decoder.tokenizer("hello world")["input_ids"][-1:]
    huge = "hello world " * 2_500_000  # 30 MB
    start = time.perf_counter()
    too_long, too_big = decoder.process_generate([huge, huge], sampling, (2,))
    assert time.perf_counter() - start < 2.0
    assert f"is longer than {decoder.max_model_len} tokens" in too_long.message
    assert "truncate_prompt_tokens keeps the last tokens" in too_big.message


def test_huge_texts_cost_what_they_keep(processors):
    bert, cross = processors["bert"], processors["bert-cross-encoder"]
    huge = "the quick brown fox jumps over the lazy dog. " * 700_000  # 31.5 MB
    spaces = " " * 30_000_000
    start = time.perf_counter()
    refused, truncated, sparse = bert.process(
        [huge, huge, spaces], [*_params(1), *_params(2, truncate_prompt_tokens=-1)]
    )
    [pair] = cross.process_pairs([("what jumps?", huge)], _params(1, truncate_prompt_tokens=-1))
    [pair_refused] = cross.process_pairs([("what jumps?", huge)], _params(1))
    assert time.perf_counter() - start < 2.0
    assert refused.message.startswith(
        f"the prompt is longer than {MAX_LEN} tokens, the model's maximum (max_model_len): "
        "its first 4,096 of 31,500,000 characters already give"
    )
    assert truncated.prompt_token_ids == _reference(bert, huge[:10_000], MAX_LEN)
    assert sparse.message.startswith("the prompt has 30,000,000 characters and its first")
    ref = cross.tokenizer("what jumps?", huge[:10_000], truncation=True, max_length=MAX_LEN)
    assert pair.prompt_token_ids == ref["input_ids"]
    assert pair_refused.message.startswith(f"the pair is longer than {MAX_LEN} tokens")


def test_concurrent_calls_equal_sequential_ones(processors):
    """8 threads at once on one processor (and its transformers tokenizer, whose truncation
    setting other callers change meanwhile) give what one thread gives."""
    bert, cross = processors["bert"], processors["bert-cross-encoder"]
    texts = _random_texts(seed=11, num=16, max_pieces=2_000)
    jobs = [(texts[k::4], tpt) for k in range(4) for tpt in (None, 5, 64, -1)]
    pair_jobs = [(list(zip(texts[k::4], texts[::-1][k::4], strict=True)), 9) for k in range(4)]

    def run(job):
        batch, tpt = job
        return [
            _ids(r) for r in bert.process(batch, _params(len(batch), truncate_prompt_tokens=tpt))
        ]

    def run_pairs(job):
        batch, tpt = job
        items = cross.process_pairs(batch, _params(len(batch), truncate_prompt_tokens=tpt))
        return [_ids(r) for r in items]

    def meddle(_):  # transformers sets truncation on its backend at each call
        return bert.tokenizer(texts[:4], truncation=True, max_length=7)["input_ids"]

    expected = [run(j) for j in jobs] + [run_pairs(j) for j in pair_jobs]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            got = pool.map(run, jobs * 2)
            got_pairs = pool.map(run_pairs, pair_jobs * 2)
            list(pool.map(meddle, range(8)))
            assert list(got) == expected[: len(jobs)] * 2
            assert list(got_pairs) == expected[len(jobs) :] * 2


def _ids(item):
    if isinstance(item, RequestError):
        return item.message
    return item.prompt_token_ids, item.token_type_ids
