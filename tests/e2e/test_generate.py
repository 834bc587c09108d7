"""LLM.generate / LLM.chat end to end on a tiny random Llama: text, stop strings and tokens, seeds,
n > 1, logprobs, chat template, metrics, errors."""

from __future__ import annotations

import math

import pytest
import torch

from tidepool import LLM, BatchInputError, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital", "Hello world! Streaming"]


@pytest.fixture(scope="module")
def llm(tiny_decoder_llm):
    return tiny_decoder_llm("llama")


def _greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_text_is_the_decoded_tokens(llm):
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        completion = out.outputs[0]
        assert out.prompt == prompt and out.finished and out.finish_reason == "length"
        assert out.prompt_token_ids == tokenizer(prompt)["input_ids"]
        # Random bytes may end inside a UTF-8 character: like vLLM, those stay held back.
        decoded = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == decoded.rstrip("\ufffd")
        assert completion.index == 0 and completion.stop_reason is None
    # Token-id prompts give the same tokens.
    by_ids = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], _greedy())
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in outs]
    assert by_ids[0].prompt is None


def test_stop_strings_and_stop_tokens(llm):
    [full] = llm.generate(PROMPTS[:1], _greedy(40), use_tqdm=False)
    text, token_ids = full.outputs[0].text, full.outputs[0].token_ids
    stop = text[10:13]
    assert stop and text.find(stop) == 10
    [cut] = llm.generate(PROMPTS[:1], _greedy(40, stop=[stop]), use_tqdm=False)
    completion = cut.outputs[0]
    assert completion.text == text[:10]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert token_ids[: len(completion.token_ids)] == completion.token_ids
    assert len(completion.token_ids) < len(token_ids)
    [kept] = llm.generate(
        PROMPTS[:1], _greedy(40, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )
    assert kept.outputs[0].text == text[:13]
    # A stop token id: generation ends on it (kept in token_ids, not in the text).
    stop_token = token_ids[5]
    first = token_ids.index(stop_token)
    [by_token] = llm.generate(PROMPTS[:1], _greedy(40, stop_token_ids=[stop_token]), use_tqdm=False)
    assert by_token.outputs[0].token_ids == token_ids[: first + 1]
    assert by_token.outputs[0].stop_reason == stop_token
    assert llm.engine.scheduler.requests == {}  # nothing left behind in the engine


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(PROMPTS, [seeded, unseeded, unseeded], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    # n = 3: three completions of one prompt; a seed gives completion i the seed + i.
    [multi] = llm.generate(PROMPTS[:1], SamplingParams(n=3, seed=7, max_tokens=16, ignore_eos=True))
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert (
        multi.outputs[0].token_ids
        == llm.generate(
            PROMPTS[:1], SamplingParams(seed=7, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1


def test_logprobs_match_transformers(llm, hf_decoder):
    model, tokenizer = hf_decoder("llama")
    [out] = llm.generate(PROMPTS[:1], _greedy(6, logprobs=3), use_tqdm=False)
    completion = out.outputs[0]
    ids = torch.tensor([out.prompt_token_ids + completion.token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(model(ids).logits[0].float(), -1)
    start = len(out.prompt_token_ids) - 1
    total = 0.0
    for pos, (token, position) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        expected = ref[start + pos]
        assert position[token].rank == 1  # greedy: the likeliest token
        assert math.isclose(position[token].logprob, expected[token].item(), abs_tol=1e-4)
        top = sorted(position.items(), key=lambda item: item[1].rank)
        assert [t for t, _ in top] == expected.topk(3).indices.tolist()
        assert position[token].decoded_token == tokenizer.decode([token])
        total += position[token].logprob
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-5)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    [out] = llm.chat(messages, _greedy(8), use_tqdm=False)
    expected_ids = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert out.prompt_token_ids == list(expected_ids)
    assert out.prompt_token_ids.count(1) == 1  # one BOS: the template's, none added on top
    [same] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, _greedy(8), use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "x"}]], _greedy(4))
    assert len(two) == 2


def test_metrics_and_length_limits(tiny_decoder_path):
    llm = LLM(str(tiny_decoder_path("llama")), dtype="float32", max_model_len=32)
    prompt_ids = llm.get_tokenizer()(PROMPTS[0])["input_ids"]
    with pytest.raises(BatchInputError) as info:
        llm.generate([PROMPTS[0], "x " * 40], SamplingParams(max_tokens=None, ignore_eos=True))
    assert [e.index for e in info.value.errors] == [1]
    assert "max_model_len" in info.value.errors[0].message
    [out] = [o for o in info.value.outputs if o is not None]
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt_ids) + len(out.outputs[0].token_ids) == 32  # ran to max_model_len
    metrics = llm.get_metrics()
    assert metrics.prompt_tokens == len(prompt_ids)
    assert metrics.generation_tokens == 32 - len(prompt_ids)
    assert metrics.num_requests_running == metrics.num_requests_waiting == 0
    assert metrics.prefix_cache_requests == 1


def test_wrong_model_kind_errors(tiny_decoder_llm, llm):
    with pytest.raises(ValueError, match="generate\\(\\) needs a generative model"):
        tiny_decoder_llm("llama-embed").generate("hi")
    # One rule for calls the model cannot serve at all (issue 18): refused up front, before any
    # prompt is tokenized, not once per prompt.
    with pytest.raises(ValueError, match=r"embed\(\) needs an embedding model") as refused:
        llm.embed("hi", use_tqdm=False)
    assert not isinstance(refused.value, BatchInputError)


def test_window_detokenizer_matches_the_stream(llm):
    """The fallback for slow tokenizers (decode windows) gives the stream's text."""
    from tidepool.engine.output_processor import _StreamDetokenizer, _WindowDetokenizer

    tokenizer = llm.get_tokenizer()
    prompt = tokenizer("Hello world!")["input_ids"]
    ids = tokenizer(" Ünïcödé 中文 tokens, one at a time.", add_special_tokens=False)["input_ids"]
    texts = []
    for cls in (_StreamDetokenizer, _WindowDetokenizer):
        detokenizer = cls(tokenizer, prompt, True)
        texts.append("".join(detokenizer.add([t]) for t in ids))
    assert texts[0] == texts[1] == tokenizer.decode(ids)
