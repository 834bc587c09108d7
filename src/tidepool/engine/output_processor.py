"""Engine-core outputs of generating requests → RequestOutputs: incremental detokenization, stop
strings, logprobs.

Detokenization is incremental: each new token adds only the text it completes. With a fast
tokenizer this is tokenizers' DecodeStream (Rust, cheap per token), primed with the end of the
prompt so that a first token like "▁Hello" keeps its leading space, as vLLM does; otherwise it
decodes a short window of tokens (vLLM's prefix / read offsets).

`spaces_between_special_tokens` joins added tokens (special ones included) to the text around them
with spaces, as slow tokenizers of transformers 4 did; transformers 5 ignores the flag, so the
window detokenizer applies it itself. The stream (fast tokenizers) cannot: tokenizers' Rust decoder
has no such option, and vLLM ignores the flag for fast tokenizers too.

Stop strings are searched in the new text only (plus the few characters before it that a stop
string could start in). When one is found, the text is cut before it (after it with
include_stop_str_in_output) and the request is reported for the engine to stop.

Streamed requests (`add_request(..., stream=True)`, the server's) get a delta RequestOutput every
step that adds text: the new text, token ids and logprobs since the last delta. While a stop string
could still be completing, its possible start is held back (the longest stop string minus one
character), so that the deltas never show text that the stop string later cuts: the deltas of a
request always concatenate to the text a non-streamed request gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidepool.core.outputs import EngineCoreOutput
from tidepool.outputs import CompletionOutput, Logprob, RequestOutput
from tidepool.params import SamplingParams

# Prompt tokens that prime the detokenizer (vLLM primes with 4 to 24 of them).
_PRIME_MIN, _PRIME_MAX = 4, 24


class _StreamDetokenizer:
    """tokenizers' DecodeStream over a fast tokenizer's Rust backend."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in _prime_tokens(tokenizer, prompt_token_ids):
            self._step(token_id)

    def _step(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception:  # an id the backend cannot decode (e.g. past the vocabulary)
            return ""

    def add(self, token_ids: list[int]) -> str:
        return "".join(self._step(t) for t in token_ids)


class _WindowDetokenizer:
    """Any tokenizer: decode a window of ids and keep what the new tokens added."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaced_ids: frozenset[int] = frozenset()
        """Added tokens that get a space on each side (empty: decode plainly)."""
        if spaces_between_special_tokens:
            self.spaced_ids = frozenset(getattr(tokenizer, "get_added_vocab", dict)().values())
        self.skipped_ids = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
        self.ids = _prime_tokens(tokenizer, prompt_token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if not self.spaced_ids.intersection(ids):
            return self._decode_plain(ids)
        # Worked example: [Hello, <extra>, world] → "Hello <extra> world" (plain: "Hello<extra>world").
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id not in self.spaced_ids:
                run.append(token_id)
                continue
            if run:
                parts.append(self._decode_plain(run))
                run = []
            if token_id not in self.skipped_ids:
                parts.append(self.tokenizer.decode([token_id], skip_special_tokens=False))
        if run:
            parts.append(self._decode_plain(run))
        return " ".join(parts)

    def _decode_plain(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]


def _prime_tokens(tokenizer: Any, prompt_token_ids: list[int]) -> list[int]:
    """The shortest prompt suffix (4 to 24 tokens) that decodes to whole characters."""
    if len(prompt_token_ids) <= _PRIME_MIN:
        return list(prompt_token_ids)
    for length in range(_PRIME_MIN, min(len(prompt_token_ids), _PRIME_MAX) + 1):
        suffix = prompt_token_ids[-length:]
        if "\ufffd" not in tokenizer.decode(suffix):
            return list(suffix)
    return list(prompt_token_ids[-_PRIME_MIN:])


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """(stop string, length to cut the text to) for the first stop string that ends in the new
    text, or None. Worked example: text "Hello wor|ld." (new text after |), stop ["ld"] → found at
    10 → cut to 10 ("Hello wor"), or to 12 with include_in_output."""
    for stop_str in stop:
        start = max(len(text) - num_new_chars - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index == -1:
            continue
        return stop_str, index + len(stop_str) if include_in_output else index
    return None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: _StreamDetokenizer | _WindowDetokenizer | None
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stream: bool = False
    """Report a delta every step that adds text, not only the final output."""
    num_held_back_chars: int = 0
    """Characters at the end of the text a streamed delta does not show yet (a stop string may
    start there)."""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_cached_tokens: int = 0
    """The prefix-cache hit the engine core reported (RequestOutput.num_cached_tokens)."""


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self._fast = hasattr(tokenizer, "backend_tokenizer")

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        stream: bool = False,
    ) -> None:
        detokenizer: _StreamDetokenizer | _WindowDetokenizer | None = None
        if params.detokenize and self.tokenizer is not None and self._fast:
            detokenizer = _StreamDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
        elif params.detokenize and self.tokenizer is not None:
            detokenizer = _WindowDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        state = _RequestState(request_id, prompt, prompt_token_ids, params, detokenizer, index)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if stream:
            state.stream = True
            if params.stop and not params.include_stop_str_in_output:
                state.num_held_back_chars = max(len(s) for s in params.stop) - 1
        self.states[request_id] = state

    def abort_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """(RequestOutputs, [(request_id, stop string)] the engine must stop).

        The outputs are the finished requests, plus a delta for each streamed request whose text
        grew (`finished=False`)."""
        finished: list[RequestOutput] = []
        to_stop: list[tuple[str, str]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted here already
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            state.num_cached_tokens = out.num_cached_tokens
            state.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and state.logprobs is not None:
                self._add_logprobs(state, out)
            if state.detokenizer is not None:
                stop = self._detokenize(state, out.new_token_ids, finish_reason)
                if stop is not None:
                    if finish_reason is None:
                        to_stop.append((out.request_id, stop))
                    finish_reason, stop_reason = "stop", stop
            if finish_reason is not None:
                del self.states[out.request_id]
                finished.append(self._output(state, finish_reason, stop_reason))
            elif state.stream and (delta := self._delta(state)) is not None:
                finished.append(delta)
        return finished, to_stop

    def _detokenize(
        self, state: _RequestState, new_token_ids: list[int], finish_reason: str | None
    ) -> str | None:
        """Add the new tokens' text; returns the stop string that ended it, if any."""
        params = state.params
        stopped_by_token = finish_reason == "stop"
        if stopped_by_token and not params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]  # EOS / a stop token adds no text (vLLM)
        assert state.detokenizer is not None  # called for detokenized requests only
        new_text = state.detokenizer.add(new_token_ids)
        state.text += new_text
        if not params.stop or stopped_by_token or not new_text:
            return None
        found = find_stop_string(
            state.text,
            len(new_text),
            params.stop,  # type: ignore[arg-type]
            params.include_stop_str_in_output,
        )
        if found is None:
            return None
        stop_str, cut = found
        state.text = state.text[:cut]
        return stop_str

    def _add_logprobs(self, state: _RequestState, out: EngineCoreOutput) -> None:
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        logprobs = state.logprobs
        assert logprobs is not None and state.cumulative_logprob is not None  # logprobs asked
        for position, token_id in zip(out.new_logprobs or (), out.new_token_ids, strict=True):
            entry = {
                tid: Logprob(logprob, rank, decode([tid]) if decode else None)
                for tid, logprob, rank in position
            }
            logprobs.append(entry)
            state.cumulative_logprob += entry[token_id].logprob

    @staticmethod
    def _output(state: _RequestState, finish_reason: str, stop_reason: Any) -> RequestOutput:
        if state.stream:  # the final delta: everything not sent yet
            return OutputProcessor._make_delta(state, len(state.text), finish_reason, stop_reason)
        completion = CompletionOutput(
            index=state.index,
            text=state.text,
            token_ids=state.token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=True,
            num_cached_tokens=state.num_cached_tokens,
        )

    @staticmethod
    def _delta(state: _RequestState) -> RequestOutput | None:
        """An unfinished request's delta, or None when it has no new text to show. Tokens whose
        text is not shown yet (an incomplete character, a held-back stop-string start) wait for
        the next delta, so each delta's tokens and text stay together."""
        end = len(state.text) - state.num_held_back_chars
        if end <= state.num_sent_chars:
            return None
        return OutputProcessor._make_delta(state, end, None, None)

    @staticmethod
    def _make_delta(
        state: _RequestState, end: int, finish_reason: str | None, stop_reason: Any
    ) -> RequestOutput:
        first_token = state.num_sent_tokens
        completion = CompletionOutput(
            index=state.index,
            text=state.text[state.num_sent_chars : end],
            token_ids=state.token_ids[first_token:],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[first_token:],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        state.num_sent_chars, state.num_sent_tokens = end, len(state.token_ids)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
            num_cached_tokens=state.num_cached_tokens,
        )
