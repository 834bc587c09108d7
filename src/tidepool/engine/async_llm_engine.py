"""vLLM's `AsyncLLMEngine` over tidepool's AsyncEngine (engine/async_engine.py, the server's):
`from_engine_args(AsyncEngineArgs(...))`, then `async for out in engine.encode(prompt,
pooling_params, request_id)` (one final output, as vLLM's pooling yields), `generate(...)` for
generating models (streamed per SamplingParams.output_kind), `abort`, `shutdown`. The engine thread starts on the first
request; each call's prompt is tokenized off the event loop."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tidepool.engine.args import AsyncEngineArgs, EngineArgs
from tidepool.engine.async_engine import AsyncEngine
from tidepool.engine.generation_stream import GenerationInput, GenerationStream
from tidepool.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from tidepool.params import PoolingParams, RequestOutputKind, SamplingParams


class AsyncLLMEngine:
    """An async engine for pooling (and generating) requests, with vLLM's method names."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._started = False
        self._streams: dict[str, GenerationStream] = {}
        """request_id → the stream of a generate() call in flight (for abort)."""
        self._aborted: dict[str, bool] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_: Any) -> AsyncLLMEngine:
        """vLLM's constructor (its usage_context and similar keywords have no effect here)."""
        config = engine_args.to_engine_config()
        return cls(AsyncEngine(config))

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args: Any) -> AsyncLLMEngine:
        return cls.from_engine_args(AsyncEngineArgs(model=model, **engine_args))

    def _start(self) -> None:
        if not self._started:
            self.engine.start()
            self._started = True

    @property
    def model_config(self):
        return self.engine.model_config

    async def get_model_config(self):
        return self.engine.model_config

    async def get_tokenizer(self, lora_request: None = None):
        return self.engine.tokenizer

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        pooling_task: str | None = None,
        lora_request: None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """One prompt's pooled output (yielded once, finished). `pooling_task`, or the params'
        task, or the model's default task."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported here: tidepool has no LoRA adapters")
        if tokenization_kwargs:
            raise ValueError(
                "AsyncLLMEngine.encode(tokenization_kwargs=...) is not supported here: set "
                "truncate_prompt_tokens / truncation_side on the PoolingParams"
            )
        params = pooling_params or PoolingParams()
        task = pooling_task or params.task or self.model_config.default_pooling_task
        self._start()
        (output,) = await self.engine.encode([prompt], [params.with_task(task)])  # type: ignore[arg-type]
        if request_id is not None:
            output = dataclasses.replace(output, request_id=request_id)
        yield output

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **_: Any,
    ) -> AsyncIterator[RequestOutput]:
        """A generating model's completions of one prompt, streamed as vLLM's AsyncLLM streams
        them: per the params' output_kind, after each engine step that adds text, the
        completions so far (CUMULATIVE, the default) or the new part (DELTA); or the finished
        output once (FINAL_ONLY). n > 1: one RequestOutput carries every completion (their
        `index`). `abort(request_id)` ends the stream with a last output whose completions'
        finish_reason is "abort"; leaving the loop early aborts the requests too."""
        params = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        self._start()
        children = [
            params
            if params.n == 1
            else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + k
            )
            for k in range(params.n)
        ]
        requests = await self.engine.process_generate([prompt] * params.n, children)
        text = prompt if isinstance(prompt, str) else (prompt or {}).get("prompt")
        inputs = [GenerationInput(r, text, k) for k, r in enumerate(requests)]
        kind = params.output_kind
        stream = self.engine.generate(inputs, stream=kind is not RequestOutputKind.FINAL_ONLY)
        self._streams[request_id] = stream
        shaper = _OutputShaper(request_id, text, requests[0].prompt_token_ids, params.n, kind)
        try:
            async for outputs in stream:
                shaped = shaper.add(outputs)
                if shaped is not None:
                    yield shaped
            if self._aborted.pop(request_id, False):
                yield shaper.aborted()
        finally:
            stream.abort()  # nothing once it ended
            self._streams.pop(request_id, None)
            self._aborted.pop(request_id, None)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort a generating request: its stream ends with a last "abort" output (vLLM's
        AsyncLLM.abort). Pooling requests are aborted when their caller stops awaiting them."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            stream = self._streams.get(rid)
            if stream is not None:
                self._aborted[rid] = True
                stream.abort()

    async def shutdown_async(self, timeout_s: float = 30.0) -> None:
        if self._started:
            await self.engine.shutdown(timeout_s)
            self._started = False

    def shutdown(self) -> None:
        """Stop the engine thread (from outside the event loop)."""
        import asyncio

        if self._started:
            asyncio.run(self.engine.shutdown(5.0))
            self._started = False


class _OutputShaper:
    """One generate() call's RequestOutputs in vLLM's shape, from the engine's per-step deltas
    (a delta per completion whose text grew; each completion's final output last)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        n: int,
        kind: RequestOutputKind,
    ) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.n, self.kind = n, kind
        self.sofar: dict[int, CompletionOutput] = {}
        """Completion index → its text, tokens and logprobs so far."""
        self.num_cached_tokens: int | None = None

    def add(self, outputs: list[RequestOutput]) -> RequestOutput | None:
        """This step's output to yield; None while FINAL_ONLY waits for every completion."""
        deltas = []
        for out in outputs:
            self.num_cached_tokens = out.num_cached_tokens
            for delta in out.outputs:
                deltas.append(delta)
                self._accumulate(delta)
        finished = len(self.sofar) == self.n and all(
            c.finish_reason is not None for c in self.sofar.values()
        )
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.kind is RequestOutputKind.DELTA:
            return self._output(sorted(deltas, key=lambda c: c.index), finished)
        return self._output(self._cumulative(), finished)

    def aborted(self) -> RequestOutput:
        """The last output after abort(): every unfinished completion ends with "abort"."""
        for index in range(self.n):
            completion = self.sofar.setdefault(index, CompletionOutput(index, "", []))
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        if self.kind is RequestOutputKind.DELTA:
            empty = [
                dataclasses.replace(c, text="", token_ids=[], logprobs=None)
                for c in self._cumulative()
            ]
            return self._output(empty, True)
        return self._output(self._cumulative(), True)

    def _accumulate(self, delta: CompletionOutput) -> None:
        sofar = self.sofar.get(delta.index)
        if sofar is None:
            self.sofar[delta.index] = dataclasses.replace(
                delta,
                token_ids=list(delta.token_ids),
                logprobs=None if delta.logprobs is None else list(delta.logprobs),
            )
            return
        sofar.text += delta.text
        sofar.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None and sofar.logprobs is not None:
            sofar.logprobs.extend(delta.logprobs)
        sofar.cumulative_logprob = delta.cumulative_logprob
        sofar.finish_reason, sofar.stop_reason = delta.finish_reason, delta.stop_reason

    def _cumulative(self) -> list[CompletionOutput]:
        """Copies of the completions so far (the caller may keep each yielded output)."""
        return [
            dataclasses.replace(
                c,
                token_ids=list(c.token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs),
            )
            for _, c in sorted(self.sofar.items())
        ]

    def _output(self, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
        )
