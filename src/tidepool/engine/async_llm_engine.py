"""vLLM's `AsyncLLMEngine` over tidepool's AsyncEngine (engine/async_engine.py, the server's):
`from_engine_args(AsyncEngineArgs(...))`, then `async for out in engine.encode(prompt,
pooling_params, request_id)` (one final output, as vLLM's pooling yields), `generate(...)` for
generating models (the final output), `abort`, `shutdown`. The engine thread starts on the first
request; each call's prompt is tokenized off the event loop."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from tidepool.engine.args import AsyncEngineArgs, EngineArgs
from tidepool.engine.async_engine import AsyncEngine
from tidepool.engine.generation_stream import GenerationInput
from tidepool.outputs import PoolingRequestOutput, RequestOutput
from tidepool.params import PoolingParams, SamplingParams


class AsyncLLMEngine:
    """An async engine for pooling (and generating) requests, with vLLM's method names."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._started = False

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
        """A generating model's completion of one prompt: its final output, once."""
        params = sampling_params or SamplingParams()
        self._start()
        (request,) = await self.engine.process_generate([prompt], [params])
        text = prompt if isinstance(prompt, str) else (prompt or {}).get("prompt")
        stream = self.engine.generate([GenerationInput(request, text, 0)], stream=False)
        async for outputs in stream:
            for output in outputs:
                if request_id is not None:
                    output = dataclasses.replace(output, request_id=request_id)
                yield output

    async def abort(self, request_id: str) -> None:
        """Nothing to do: a request is aborted when its caller stops awaiting it."""

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
