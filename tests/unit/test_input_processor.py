"""InputProcessor: prompts → Requests (tokenization, pairs, truncation, sentence-transformers
prompts and lower-casing). Needs only config.json and tokenizer files; no weights are loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tidepool.engine.input_processor import InputProcessor
from tidepool.models.resolve import build_model_config
from tidepool.outputs import RequestError
from tidepool.params import PoolingParams
from tidepool.request import Request

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "中文 🙂", "  a  "]


def _processor(path: Path, **config_kwargs) -> InputProcessor:
    return InputProcessor(build_model_config(str(path), device="cpu", **config_kwargs))


@pytest.fixture(scope="module")
def bert(tiny_model_path) -> InputProcessor:
    return _processor(tiny_model_path("bert"))


def _params(n: int, **kwargs) -> list[PoolingParams]:
    return [PoolingParams(task="embed", **kwargs) for _ in range(n)]


def test_texts_tokenize_like_the_tokenizer_in_order(bert):
    requests = bert.process(TEXTS, _params(len(TEXTS)))
    expected = bert.tokenizer(TEXTS)["input_ids"]
    assert all(isinstance(r, Request) for r in requests)
    assert [r.prompt_token_ids for r in requests] == expected
    assert len({r.request_id for r in requests}) == len(TEXTS)
    # Single texts have all-zero token types: dropped, the model adds type 0 itself.
    assert all(r.token_type_ids is None for r in requests)


def test_token_id_prompts_pass_through(bert):
    ids = [101, 7592, 2088, 102]
    [request] = bert.process([{"prompt_token_ids": ids}], _params(1))
    assert request.prompt_token_ids == ids
    [truncated] = bert.process([{"prompt_token_ids": ids}], _params(1, truncate_prompt_tokens=2))
    assert truncated.prompt_token_ids == ids[:2]
    # A dict with both keys: the token ids win (no re-tokenization).
    [both] = bert.process([{"prompt": "ignored", "prompt_token_ids": ids}], _params(1))
    assert both.prompt_token_ids == ids


def test_truncation_keeps_special_tokens_and_order(bert):
    long_text = "tide " * 300
    lengths = [None, 5, -1, 5, None]
    prompts = ["short one", long_text, long_text, "tiny", "another short one"]
    params = [PoolingParams(task="embed", truncate_prompt_tokens=n) for n in lengths]
    results = bert.process(prompts, params)
    assert [len(r.prompt_token_ids) for r in results] == [
        len(bert.tokenizer(prompts[0])["input_ids"]),
        5,
        bert.max_model_len,
        3,  # [CLS] tiny [SEP]: shorter than the limit, untouched
        len(bert.tokenizer(prompts[4])["input_ids"]),
    ]
    for r in results:
        assert r.prompt_token_ids[0] == bert.tokenizer.cls_token_id
        assert r.prompt_token_ids[-1] == bert.tokenizer.sep_token_id


def test_length_check_and_truncation_limit(bert):
    exact = [101] + [7592] * (bert.max_model_len - 2) + [102]
    ok, too_long, too_much = bert.process(
        [{"prompt_token_ids": exact}, {"prompt_token_ids": [*exact, 102]}, "x"],
        [*_params(2), PoolingParams(task="embed", truncate_prompt_tokens=bert.max_model_len + 1)],
    )
    assert isinstance(ok, Request) and ok.num_prompt_tokens == bert.max_model_len
    assert isinstance(too_long, RequestError) and too_long.index == 1
    assert f"{bert.max_model_len + 1} tokens" in too_long.message
    assert too_much == RequestError(
        2,
        f"truncate_prompt_tokens={bert.max_model_len + 1} is larger than "
        f"max_model_len={bert.max_model_len}",
    )


def test_pairs_match_tokenizer_pair_encoding(tiny_model_path):
    processor = _processor(tiny_model_path("bert-cross-encoder"))
    pairs = [("what is a tide pool?", "a rocky pool left by the sea"), ("q", "d")]
    results = processor.process_pairs(pairs, _params(2))
    for (first, second), r in zip(pairs, results, strict=True):
        enc = processor.tokenizer(first, second)
        assert r.prompt_token_ids == enc["input_ids"]
        assert r.token_type_ids == enc["token_type_ids"]
        assert r.token_type_ids[-1] == 1
    [truncated] = processor.process_pairs(pairs[:1], _params(1, truncate_prompt_tokens=8))
    assert len(truncated.prompt_token_ids) == 8
    assert truncated.prompt_token_ids.count(processor.tokenizer.sep_token_id) == 2


def test_roberta_has_no_token_types(tiny_model_path):
    processor = _processor(tiny_model_path("roberta-classifier"))
    assert not processor.keep_token_types
    [request] = processor.process_pairs([("query", "document")], _params(1))
    assert request.token_type_ids is None
    assert request.prompt_token_ids == processor.tokenizer("query", "document")["input_ids"]
    # RoBERTa's positions start at padding_idx + 1: two fewer usable positions.
    assert processor.max_model_len == 128 - 2


def test_sentence_transformers_prompt_lowercase_and_max_length(tiny_model_path, tmp_path):
    folder = tmp_path / "st_roberta"
    shutil.copytree(tiny_model_path("roberta"), folder)
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 16, "do_lower_case": True})
    )
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps(
            {"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"}
        )
    )
    processor = _processor(folder)
    assert processor.max_model_len == 16
    [request] = processor.process(["The Quick Fox"], _params(1))
    # The cased BPE tokenizer sees the prompt prepended and the text lower-cased.
    assert request.prompt_token_ids == processor.tokenizer("query: the quick fox")["input_ids"]
    assert request.prompt_token_ids != processor.tokenizer("The Quick Fox")["input_ids"]
    with pytest.raises(ValueError, match="max_model_len=17 is larger than the model allows"):
        build_model_config(str(folder), device="cpu", max_model_len=17)


def test_left_truncation_keeps_the_last_tokens(bert, tiny_model_path):
    """truncation_side="left" (Cohere's START, TEI's Left) equals transformers' left truncation."""
    text = " ".join(f"w{i}" for i in range(200))
    left, right = bert.process(
        [text, text],
        [
            PoolingParams(task="embed", truncate_prompt_tokens=9, truncation_side="left"),
            PoolingParams(task="embed", truncate_prompt_tokens=9),
        ],
    )
    bert.tokenizer.truncation_side = "left"
    try:
        expected = bert.tokenizer(text, truncation=True, max_length=9)["input_ids"]
    finally:
        bert.tokenizer.truncation_side = "right"
    assert left.prompt_token_ids == expected
    assert (
        right.prompt_token_ids == bert.tokenizer(text, truncation=True, max_length=9)["input_ids"]
    )
    assert left.prompt_token_ids[1:-1] != right.prompt_token_ids[1:-1]
    [ids] = bert.process(
        [{"prompt_token_ids": [1, 2, 3, 4]}],
        _params(1, truncate_prompt_tokens=2, truncation_side="left"),
    )
    assert ids.prompt_token_ids == [3, 4]
    # Without truncate_prompt_tokens the side changes nothing; a huge text is refused, not read.
    [short] = bert.process(["tide pool"], _params(1, truncation_side="left"))
    assert short.prompt_token_ids == bert.tokenizer("tide pool")["input_ids"]
    [huge] = bert.process(
        ["x " * 10**6], _params(1, truncate_prompt_tokens=-1, truncation_side="left")
    )
    assert isinstance(huge, RequestError) and "whole text" in huge.message
    # Pairs: the last tokens of each side, the special tokens in place.
    processor = _processor(tiny_model_path("bert-cross-encoder"))
    pair = ("first " + text, "second " + text)
    [cut] = processor.process_pairs(
        [pair], _params(1, truncate_prompt_tokens=11, truncation_side="left")
    )
    processor.tokenizer.truncation_side = "left"
    try:
        enc = processor.tokenizer(*pair, truncation="longest_first", max_length=11)
    finally:
        processor.tokenizer.truncation_side = "right"
    assert cut.prompt_token_ids == enc["input_ids"]
    assert cut.token_type_ids == enc["token_type_ids"]
