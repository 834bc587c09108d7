"""InputProcessor: prompts → Requests (tokenization, pairs, truncation, sentence-transformers
prompts and lower-casing). Needs only config.json and tokenizer files; no weights are loaded."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tidepool.engine.input_processor import InputProcessor
from tidepool.model_loader.resolve import build_model_config
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


@pytest.mark.parametrize(
    "prompt, message",
    [
        (
            {"prompt": "hello world", "multi_modal_data": {"image": object()}},
            r"multi_modal_data: this model takes text and token ids only",
        ),
        (
            {"prompt_token_id": [101, 7592, 102]},
            r"unknown key 'prompt_token_id' in the prompt dict \('prompt_token_id': did you mean "
            r"'prompt_token_ids'\?\)",
        ),
        (
            {"prompt": "hello", "lang": "en"},
            r"unknown key 'lang' in the prompt dict; a dict prompt",
        ),
        ({"prompt": "hello", "cache_salt": "tenant-1"}, r"cache_salt is not supported"),
        (
            {"prompt_token_ids": [101, 102], "token_type_ids": [0, 0]},
            r"token_type_ids in a prompt dict is not supported",
        ),
        ({"prompt_embeds": [[0.0]]}, r"prompt_embeds \(an EmbedsPrompt\) is not supported"),
        (
            {"prompt": "hello", "mm_processor_kwargs": {"fps": 1}},
            r"mm_processor_kwargs is not supported",
        ),
    ],
)
def test_prompt_dict_keys_it_cannot_read_are_refused(bert, prompt, message):
    """A key is never dropped: the text-only answer to a prompt with an image, or the answer to
    a typo, would be a wrong answer. The other prompts of the batch go on."""
    results = bert.process(["fine", prompt], _params(2))
    assert isinstance(results[0], Request)
    assert isinstance(results[1], RequestError)
    assert results[1].index == 1
    assert re.search(message, results[1].message), results[1].message


def test_prompt_dict_keys_vllm_defines_pass_when_none(bert):
    """vLLM's schemas allow None for the multi-modal options: the same as leaving them out."""
    prompt = {"prompt": "hello world", "multi_modal_data": None, "mm_processor_kwargs": None}
    [request] = bert.process([prompt], _params(1))
    assert request.prompt_token_ids == bert.tokenizer("hello world")["input_ids"]


def test_generate_and_score_refuse_unknown_keys_too(tiny_model_path, tiny_decoder_path):
    from tidepool.params import SamplingParams

    decoder = _processor(tiny_decoder_path("llama"))
    [error] = decoder.process_generate(
        [{"prompt": "hello", "multi_modal_data": {"image": None}}], [SamplingParams()], (2,)
    )
    assert isinstance(error, RequestError) and "multi_modal_data" in error.message
    cross = _processor(tiny_model_path("bert-cross-encoder"))
    [error] = cross.process_pairs([("q", {"content": [{"type": "image_url"}]})], _params(1))
    assert isinstance(error, RequestError)
    assert "the second text of the pair is a dict (keys ['content'])" in error.message
    assert "multi-modal score inputs" in error.message


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


def test_offline_embed_refuses_multi_modal_data(tiny_llm):
    """LLM.embed with vLLM's multi_modal_data: that prompt fails, naming the key; the text-only
    embedding is never returned for it."""
    from tidepool.outputs import BatchInputError

    llm = tiny_llm("bert")
    with pytest.raises(BatchInputError) as info:
        llm.embed(["a tide pool", {"prompt": "a crab", "multi_modal_data": {"image": b""}}])
    [error] = info.value.errors
    assert error.index == 1 and "multi_modal_data" in error.message
    assert info.value.outputs[1] is None and info.value.outputs[0] is not None
