"""Bad inputs: each gets a precise error, the valid prompts of the same call are still computed.

Per-prompt problems raise `BatchInputError` after the batch ran: `.errors` lists
RequestError(index, message) in prompt order and `.outputs` holds the results (None where a prompt
failed). Problems with the call itself (an empty list, a wrong argument type) raise ValueError /
TypeError before any work. Runs on the tiny random BERT (max_model_len 128, vocab 30522).
"""

from __future__ import annotations

import pytest
import torch

from tidepool import BatchInputError, PoolingParams, RequestError

MAX_LEN = 128
VOCAB = 30522


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm("bert")


def _alone(llm, prompt) -> list[float]:
    return llm.embed([prompt], use_tqdm=False)[0].outputs.embedding


def test_empty_list_and_wrong_argument_types(llm):
    with pytest.raises(ValueError, match="prompts is empty: give at least one prompt"):
        llm.embed([], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.encode((), use_tqdm=False)
    for bad in (None, 42, 3.5, b"bytes", {"a", "b"}, (t for t in ["gen"])):
        with pytest.raises(
            TypeError, match="prompts must be a string, a dict prompt or a list of them, got"
        ):
            llm.embed(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="data_2 is empty"):
        llm.score("query", [], use_tqdm=False)
    with pytest.raises(TypeError, match="data_1 must be"):
        llm.score(None, ["doc"], use_tqdm=False)
    with pytest.raises(ValueError, match="data_1 has 2 items and data_2 3"):
        llm.score(["a", "b"], ["x", "y", "z"], use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 pooling_params for 2 prompts"):
        llm.embed(["a", "b"], pooling_params=[PoolingParams()], use_tqdm=False)


def test_invalid_call_parameters(llm):
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or >= 1, got 0"):
        llm.embed(["a"], truncate_prompt_tokens=0, use_tqdm=False)
    with pytest.raises(ValueError, match="unknown pooling task 'nope'"):
        llm.encode(["a"], pooling_task="nope", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be an integer"):
        PoolingParams(dimensions="8")


def test_mixed_batch_keeps_valid_outputs(llm):
    tokenizer = llm.get_tokenizer()
    long_text = "word " * 300
    long_len = len(tokenizer(long_text)["input_ids"])
    prompts = [
        "a valid first prompt",  # 0 ok
        "",  # 1
        None,  # 2
        42,  # 3
        {},  # 4
        {"prompt_token_ids": [101, VOCAB, 102]},  # 5
        long_text,  # 6
        {"prompt": "a valid dict prompt"},  # 7 ok
        {"prompt_token_ids": [101, 7592, 102]},  # 8 ok
        {"prompt": 5},  # 9
        {"prompt_token_ids": []},  # 10
        {"prompt_token_ids": [101, -1, 102]},  # 11
        {"prompt_token_ids": "101 102"},  # 12
        {"prompt_token_ids": [101, 1.5, 102]},  # 13
        ["nested", "list"],  # 14
        "  ",  # 15 ok: whitespace is a valid prompt ([CLS] [SEP])
    ]
    expected_errors = {
        1: "the prompt is an empty string",
        2: "the prompt has type None; expected a string, or a dict with 'prompt' (string) or "
        "'prompt_token_ids' (list of ints)",
        3: "the prompt has type int; expected a string, or a dict with 'prompt' (string) or "
        "'prompt_token_ids' (list of ints)",
        4: "a dict prompt needs 'prompt' or 'prompt_token_ids', got keys []",
        5: f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})",
        6: f"the prompt has {long_len} tokens, more than the model's maximum of {MAX_LEN} "
        "(max_model_len); shorten it or pass truncate_prompt_tokens to truncate",
        9: "'prompt' must be a string, got int",
        10: "'prompt_token_ids' is empty",
        11: f"token id -1 is outside the vocabulary [0, {VOCAB})",
        12: "'prompt_token_ids' must be a list of ints, got str",
        13: "'prompt_token_ids' must hold ints, found float",
        14: "the prompt has type list; expected a string, or a dict with 'prompt' (string) or "
        "'prompt_token_ids' (list of ints)",
    }
    with pytest.raises(BatchInputError) as info:
        llm.embed(prompts, use_tqdm=False)
    error = info.value
    assert isinstance(error, ValueError)  # callers catching ValueError still see it
    assert error.errors == [RequestError(i, msg) for i, msg in sorted(expected_errors.items())]
    assert len(error.outputs) == len(prompts)
    valid = [i for i in range(len(prompts)) if i not in expected_errors]
    assert [i for i, out in enumerate(error.outputs) if out is not None] == valid
    for i in valid:
        assert error.outputs[i].outputs.embedding == pytest.approx(
            _alone(llm, prompts[i]), abs=1e-5
        )
    assert error.outputs[8].prompt_token_ids == [101, 7592, 102]
    text = str(error)
    assert text.startswith(f"{len(expected_errors)} invalid prompt(s): prompt 1: the prompt is")
    assert f"(and {len(expected_errors) - 5} more)" in text


def test_over_long_text_error_gives_both_lengths_and_truncation_fixes_it(llm):
    text = "tide pool " * 100
    num_tokens = len(llm.get_tokenizer()(text)["input_ids"])
    assert num_tokens > MAX_LEN
    with pytest.raises(BatchInputError) as info:
        llm.embed(text, use_tqdm=False)
    [err] = info.value.errors
    assert f"has {num_tokens} tokens" in err.message and f"maximum of {MAX_LEN}" in err.message
    assert info.value.outputs == [None]
    out = llm.embed(text, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == MAX_LEN
    # Token-id prompts are truncated too, and too long ones are refused with both lengths.
    ids = [101] + [7592] * 200 + [102]
    with pytest.raises(
        BatchInputError, match=f"has 202 tokens, more than the model's maximum of {MAX_LEN}"
    ):
        llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    out = llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[:10]
    # Truncation beyond the model's maximum is refused per prompt.
    with pytest.raises(
        BatchInputError, match=f"truncate_prompt_tokens=129 is larger than max_model_len={MAX_LEN}"
    ):
        llm.embed(["x"], truncate_prompt_tokens=129, use_tqdm=False)


def test_per_request_dimensions_error_spares_the_rest(llm):
    params = [PoolingParams(dimensions=8), PoolingParams(dimensions=64), PoolingParams()]
    with pytest.raises(BatchInputError) as info:
        llm.embed(["first", "second", "third"], pooling_params=params, use_tqdm=False)
    assert info.value.errors == [
        RequestError(1, "dimensions=64 is larger than the model's embedding size 32")
    ]
    first, second, third = info.value.outputs
    assert second is None
    assert len(first.outputs.embedding) == 8 and len(third.outputs.embedding) == 32
    assert third.outputs.embedding == pytest.approx(_alone(llm, "third"), abs=1e-5)


def test_score_pairs_with_bad_sides(llm, tiny_llm):
    # Embedding model: each text embedded once; a bad text fails only the pairs that use it.
    with pytest.raises(BatchInputError) as info:
        llm.score("query", ["good doc", "", 7], use_tqdm=False)
    assert info.value.errors == [
        RequestError(1, "data_2: the prompt is an empty string"),
        RequestError(
            2,
            "data_2: the prompt has type int; expected a string, or a dict with "
            "'prompt' (string) or 'prompt_token_ids' (list of ints)",
        ),
    ]
    good = info.value.outputs[0]
    assert good is not None and -1.0 <= good.outputs.score <= 1.0
    assert info.value.outputs[1:] == [None, None]
    # Cross-encoder: both sides are checked and named.
    cross = tiny_llm("bert-cross-encoder")
    with pytest.raises(BatchInputError) as info:
        cross.score(["q", "", "q"], ["doc", None, "doc two"], use_tqdm=False)
    assert info.value.errors == [
        RequestError(
            1,
            "the first text of the pair is an empty string; "
            "the second text of the pair has type None; expected a string",
        ),
    ]
    ok = cross.score("q", ["doc", "doc two"], use_tqdm=False)
    assert [info.value.outputs[0].outputs.score, info.value.outputs[2].outputs.score] == (
        pytest.approx([o.outputs.score for o in ok], abs=1e-6)
    )


def test_same_instance_still_works_after_errors(llm):
    before = _alone(llm, "still alive")
    for bad in (["", None], [{}], [{"prompt_token_ids": [VOCAB + 5]}], ["x " * 500]):
        with pytest.raises(BatchInputError):
            llm.embed(bad, use_tqdm=False)
    with pytest.raises(TypeError):
        llm.embed(12, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.embed(["still alive", "and well"], use_tqdm=False)
    assert outs[0].outputs.embedding == pytest.approx(before, abs=1e-6)
    assert torch.tensor(outs[1].outputs.embedding).norm() == pytest.approx(1.0, abs=1e-5)


SURROGATE = (
    "has a lone surrogate U+D800 at character 4; text must be valid Unicode "
    "(surrogates U+D800..U+DFFF cannot be encoded as UTF-8)"
)


def test_lone_surrogate_fails_that_prompt_alone(llm, tiny_llm):
    with pytest.raises(BatchInputError) as info:
        llm.embed(
            ["ok", "abc \ud800", {"prompt": "abc \ud800"}, "a\x00b \u202eשלום"], use_tqdm=False
        )
    assert info.value.errors == [
        RequestError(1, f"the prompt {SURROGATE}"),
        RequestError(2, f"the prompt {SURROGATE}"),
    ]
    ok, _, _, odd = info.value.outputs
    assert ok.outputs.embedding == pytest.approx(_alone(llm, "ok"), abs=1e-5)
    assert odd is not None  # NUL, RTL marks and Hebrew are fine
    cross = tiny_llm("bert-cross-encoder")
    with pytest.raises(BatchInputError) as info:
        cross.score("q", ["doc", "abc \ud800"], use_tqdm=False)
    assert info.value.errors == [RequestError(1, f"the second text of the pair {SURROGATE}")]
    assert info.value.outputs[0].outputs.score == pytest.approx(
        cross.score("q", "doc", use_tqdm=False)[0].outputs.score, abs=1e-6
    )


def test_truncate_prompt_tokens_below_the_special_tokens(llm):
    with pytest.raises(BatchInputError) as info:
        llm.embed(["tide " * 300, "x"], truncate_prompt_tokens=1, use_tqdm=False)
    assert [e.index for e in info.value.errors] == [0, 1]
    assert info.value.errors[0].message.startswith(
        "truncate_prompt_tokens=1 leaves no room for text: it counts the 2 special tokens"
    )
    out = llm.embed("tide " * 300, truncate_prompt_tokens=3, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 3


def test_huge_text_is_refused_quickly_and_truncated_quickly(llm):
    import time

    huge = "the tide pool is deep. " * 1_400_000  # 32 MB
    start = time.perf_counter()
    with pytest.raises(BatchInputError, match=f"is longer than {MAX_LEN} tokens") as info:
        llm.embed(["short", huge], use_tqdm=False)
    [out] = llm.embed(huge, truncate_prompt_tokens=-1, use_tqdm=False)
    assert time.perf_counter() - start < 2.0
    assert info.value.outputs[0] is not None
    assert out.outputs.embedding == pytest.approx(
        _alone(llm, {"prompt_token_ids": out.prompt_token_ids}), abs=1e-5
    )
    assert len(out.prompt_token_ids) == MAX_LEN
