"""OutputProcessor deltas (the server's streams): for any token sequence and stop strings, the
deltas of a streamed request concatenate to the text, token ids and logprobs a non-streamed request
gets, and no delta shows text that a stop string later cuts."""

from __future__ import annotations

import random

import pytest
from tiny_decoders import save_tokenizer

from tidepool.core.outputs import EngineCoreOutput
from tidepool.engine.output_processor import OutputProcessor
from tidepool.params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def run(tokenizer, token_ids: list[int], params: SamplingParams, stream: bool, max_steps: int):
    """Feed one token a step (length-finish at max_steps, as the scheduler would); returns the
    outputs and the step at which the processor asked the engine to stop."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1, 5, 6], params, stream=stream)
    outputs, stopped_at = [], None
    for step, token_id in enumerate(token_ids[:max_steps]):
        finish = "length" if step == max_steps - 1 else None
        logprobs = [[(token_id, -0.5, 1)]] if params.logprobs is not None else None
        out = EngineCoreOutput("r", [token_id], logprobs, finish)
        results, to_stop = processor.process([out])
        outputs += results
        if to_stop:
            stopped_at = step
            break
    return outputs, stopped_at


@pytest.mark.parametrize("include_stop", [False, True])
def test_deltas_concatenate_to_the_final_output(tokenizer, include_stop: bool) -> None:
    rng = random.Random(0)
    vocab = [i for i in range(6, len(tokenizer))]
    for case in range(60):
        token_ids = [rng.choice(vocab) for _ in range(24)]
        text = tokenizer.decode(token_ids)
        stops = []
        for length in rng.sample([1, 2, 3, 5], 2):  # stop strings of different lengths
            start = rng.randrange(0, max(len(text) - length, 1))
            stops.append(text[start : start + length] or "x")
        params = SamplingParams(
            stop=stops, include_stop_str_in_output=include_stop, logprobs=0, max_tokens=24
        )
        [final], stopped = run(tokenizer, token_ids, params, stream=False, max_steps=24)
        deltas, stopped_streamed = run(tokenizer, token_ids, params, stream=True, max_steps=24)
        assert stopped == stopped_streamed
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        completions = [d.outputs[0] for d in deltas]
        expected = final.outputs[0]
        assert "".join(c.text for c in completions) == expected.text, (case, stops)
        assert sum((c.token_ids for c in completions), []) == expected.token_ids
        assert sum((c.logprobs for c in completions), []) == expected.logprobs
        assert (completions[-1].finish_reason, completions[-1].stop_reason) == (
            expected.finish_reason,
            expected.stop_reason,
        )


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_spaces_between_special_tokens(tokenizer, skip_special_tokens: bool) -> None:
    """The window detokenizer (slow tokenizers) puts a space on each side of an added token, as
    transformers 4's slow tokenizers did; off, the text is the plain decode."""
    from tidepool.engine.output_processor import _WindowDetokenizer

    words = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    token_ids = [*words, tokenizer.bos_token_id, *words]

    def text(spaced: bool) -> str:
        detokenizer = _WindowDetokenizer(tokenizer, [6, 7], skip_special_tokens, spaced)
        return "".join(detokenizer.add([t]) for t in token_ids)

    bos = "" if skip_special_tokens else tokenizer.bos_token + " "
    assert text(spaced=True) == f"hello world {bos}hello world"
    assert text(spaced=False) == tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens
    )
    params = SamplingParams(spaces_between_special_tokens=False, skip_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor._fast = False  # the slow-tokenizer path
    processor.add_request("r", None, [6, 7], params)
    [out], _ = processor.process([EngineCoreOutput("r", token_ids, None, "length")])
    assert out.outputs[0].text == tokenizer.decode(token_ids, skip_special_tokens=False)
