"""/v1/completions and /v1/chat/completions: a request → SamplingParams → AsyncEngine.generate →
OpenAI's JSON, or server-sent events when `stream` is set.

    check (404 model, 400 content) → chat template (chat) → tokenize (tokenizer thread) →
    prompt + max_tokens <= max_model_len (400 with both numbers) → n requests per prompt →
    stream=false: each request's final output → one JSON answer
    stream=true:  a chunk per choice and engine step with the new text → usage chunk → [DONE]

Choice index = prompt index × n + completion index, as vLLM numbers them. A client that goes away
cancels the task reading the GenerationStream, which aborts its requests in the engine. An error
after the stream has started is sent as an event ({"error": {...}}), then [DONE].
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from tidepool.engine.async_engine import AsyncEngine
from tidepool.engine.generation_stream import GenerationInput, GenerationStream
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.errors import ApiError, ServerState, error_event
from tidepool.entrypoints.openai.inputs import format_batch_error, parse_prompts, sampling_params_of
from tidepool.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from tidepool.entrypoints.openai.metrics import ServerMetrics
from tidepool.entrypoints.openai.serving import OpenAIServing
from tidepool.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from tidepool.outputs import BatchInputError, CompletionOutput, RequestError, RequestOutput
from tidepool.params import SamplingParams
from tidepool.request import Request

SSE_DONE = "data: [DONE]\n\n"
_Choice = TypeVar("_Choice", bound=BaseModel)
COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


@dataclass
class _Prepared:
    """A checked request, tokenized, ready to hand to the engine."""

    model: str
    inputs: list[GenerationInput]
    """One per choice, in choice order."""
    num_prompt_tokens: int
    """Each prompt counted once, whatever n (as vLLM's usage)."""
    n: int


@dataclass
class _Usage:
    """Token counts of one request, kept while it streams (partial on a disconnect)."""

    num_prompt_tokens: int
    num_completion_tokens: int = 0
    details: bool = False
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (vLLM)."""
    cached: dict[int, int] = field(default_factory=dict)
    """Prompt index → its tokens read from the prefix cache (each prompt once, whatever n;
    summed over prompts, where vLLM reports the last prompt's)."""

    def note(self, output: RequestOutput, n: int) -> None:
        self.cached[output.outputs[0].index // n] = output.num_cached_tokens or 0

    def info(self) -> p.GenerationUsage:
        num_cached = sum(self.cached.values())
        return p.GenerationUsage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            total_tokens=self.num_prompt_tokens + self.num_completion_tokens,
            prompt_tokens_details=(
                p.PromptTokenUsageInfo(cached_tokens=num_cached) if self.details else None
            ),
        )


class OpenAIServingGeneration:
    def __init__(
        self,
        engine: AsyncEngine,
        serving: OpenAIServing,
        tokenization: OpenAIServingTokenization,
        metrics: ServerMetrics | None = None,
        state: ServerState | None = None,
        enable_prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.serving = serving
        self.tokenization = tokenization
        self.metrics = metrics
        self.state = state
        self.max_model_len = engine.model_config.max_model_len

    # ------------------------------------------------------------------ completions

    async def completions(
        self, req: p.CompletionRequest
    ) -> p.CompletionResponse | AsyncIterator[str]:
        model = self.serving.check_generates(req.model, "Completions")
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of is not supported (only best_of = n)", "best_of")
        if req.echo and req.logprobs is not None:
            raise ApiError(
                400, "echo with logprobs needs prompt logprobs, which are not computed", "echo"
            )
        prompts = parse_prompts(req.prompt, "prompt")
        params = sampling_params_of(req, req.max_tokens, req.logprobs)
        prep = await self._prepare(model, prompts, params, req.add_special_tokens, "prompt")
        echo_texts = await self._echo_texts(prompts, prep) if req.echo else None
        if req.stream:
            return self._completion_events(req, prep, echo_texts)

        def to_choice(index: int, completion: CompletionOutput) -> p.CompletionResponseChoice:
            prefix = echo_texts[index // prep.n] if echo_texts else ""
            logprobs = None
            if completion.logprobs is not None:
                logprobs, _ = completion_logprobs(completion, len(prefix))
            return p.CompletionResponseChoice(
                index=index,
                text=prefix + completion.text,
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )

        choices, usage = await self._final_choices(COMPLETIONS_ROUTE, prep, to_choice)
        return p.CompletionResponse(model=model, choices=choices, usage=usage)

    def _completion_events(
        self, req: p.CompletionRequest, prep: _Prepared, echo_texts: list[str] | None
    ) -> AsyncIterator[str]:
        text_offsets = [0] * len(prep.inputs)
        echoed: set[int] = set()

        def to_choice(completion: CompletionOutput) -> p.CompletionResponseChoice:
            index = completion.index
            text = completion.text
            if echo_texts and index not in echoed:  # the prompt goes before the first text
                echoed.add(index)
                text = echo_texts[index // prep.n] + text
            logprobs = None
            if completion.logprobs is not None:
                logprobs, text_offsets[index] = completion_logprobs(completion, text_offsets[index])
            else:
                text_offsets[index] += len(text)
            return p.CompletionResponseChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )

        return self._events(COMPLETIONS_ROUTE, req, prep, p.CompletionResponse, "cmpl", to_choice)

    # ------------------------------------------------------------------ chat

    async def chat(
        self, req: p.ChatCompletionRequest
    ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        model = self.serving.check_generates(req.model, "Chat Completions")
        if req.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(
                400,
                "response_format other than {'type': 'text'} is not supported",
                "response_format",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        params = sampling_params_of(req, max_tokens, num_logprobs)
        prompt = await self.tokenization.render_chat(
            req.messages,
            req.chat_template,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        prep = await self._prepare(model, [prompt], params, req.add_special_tokens, "messages")
        if req.stream:
            return self._chat_events(req, prep, num_logprobs)

        def to_choice(index: int, completion: CompletionOutput) -> p.ChatCompletionResponseChoice:
            return p.ChatCompletionResponseChoice(
                index=index,
                message=p.ChatMessage(role="assistant", content=completion.text),
                logprobs=chat_logprobs(completion, num_logprobs),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )

        choices, usage = await self._final_choices(CHAT_ROUTE, prep, to_choice)
        return p.ChatCompletionResponse(model=model, choices=choices, usage=usage)

    def _chat_events(
        self, req: p.ChatCompletionRequest, prep: _Prepared, num_logprobs: int | None
    ) -> AsyncIterator[str]:
        def to_choice(completion: CompletionOutput) -> p.ChatCompletionStreamChoice:
            return p.ChatCompletionStreamChoice(
                index=completion.index,
                delta={"content": completion.text} if completion.text else {},
                logprobs=chat_logprobs(completion, num_logprobs),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )

        role = {"role": "assistant", "content": ""}
        opening = [
            p.ChatCompletionStreamChoice(index=index, delta=role)
            for index in range(len(prep.inputs))
        ]
        return self._events(
            CHAT_ROUTE, req, prep, p.ChatCompletionStreamResponse, "chatcmpl", to_choice, opening
        )

    # ------------------------------------------------------------------ shared

    async def _prepare(
        self,
        model: str,
        prompts: list[Any],
        params: SamplingParams,
        add_special_tokens: bool,
        param: str,
    ) -> _Prepared:
        """Tokenize, check lengths, and make n requests per prompt (a seed gives completion k
        the seed + k, as offline)."""
        num_choices = params.n
        self.serving.check_count(len(prompts) * num_choices, param)
        child_prompts = [prompt for prompt in prompts for _ in range(num_choices)]
        child_params = [
            params
            if num_choices == 1
            else replace(params, n=1, seed=None if params.seed is None else params.seed + k)
            for _ in prompts
            for k in range(num_choices)
        ]
        try:
            requests = await self.engine.process_generate(
                child_prompts, child_params, add_special_tokens
            )
        except BatchInputError as e:
            by_prompt = {err.index // num_choices: err.message for err in e.errors}
            errors = [RequestError(i, message) for i, message in sorted(by_prompt.items())]
            raise ApiError(400, format_batch_error(BatchInputError(errors), param), param) from e
        inputs = []
        num_prompt_tokens = 0
        for index, request in enumerate(requests):
            self._fit_max_tokens(request, param)
            if index % num_choices == 0:
                num_prompt_tokens += request.num_prompt_tokens
            prompt = child_prompts[index]
            inputs.append(
                GenerationInput(request, prompt if isinstance(prompt, str) else None, index)
            )
        return _Prepared(model, inputs, num_prompt_tokens, num_choices)

    def _fit_max_tokens(self, request: Request, param: str) -> None:
        """400 when the prompt and max_tokens do not fit in max_model_len; max_tokens None = the
        room left."""
        params = request.sampling_params
        assert params is not None
        num_prompt_tokens = request.num_prompt_tokens
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None and room >= 1:
            request.sampling_params = replace(params, max_tokens=room)
            return
        num_completion_tokens = params.max_tokens or 1
        if num_completion_tokens > room:
            where = "messages" if param == "messages" else "prompt"
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + num_completion_tokens} tokens "
                f"({num_prompt_tokens} in the {where}, {num_completion_tokens} in the "
                f"completion). Please reduce the length of the {where} or max_tokens.",
                "max_tokens",
            )

    async def _echo_texts(self, prompts: list[Any], prep: _Prepared) -> list[str]:
        """The prompt text of each prompt: as given, or decoded from its token ids."""
        tokenizer = self.engine.tokenizer
        token_ids = [prep.inputs[i * prep.n].request.prompt_token_ids for i in range(len(prompts))]

        def decode() -> list[str]:
            return [
                prompt if isinstance(prompt, str) else tokenizer.decode(ids)
                for prompt, ids in zip(prompts, token_ids, strict=True)
            ]

        return await self.engine.run_in_tokenizer(decode)

    async def _final_choices(
        self,
        route: str,
        prep: _Prepared,
        to_choice: Callable[[int, CompletionOutput], _Choice],
    ) -> tuple[list[_Choice], p.GenerationUsage]:
        """stream=false: every choice's final output as an answer's choice, and the usage."""
        usage = _Usage(prep.num_prompt_tokens, details=self.enable_prompt_tokens_details)
        finals = await self._collect(self.engine.generate(prep.inputs, stream=False), usage, prep.n)
        choices = []
        for index, completion in enumerate(finals):
            choices.append(to_choice(index, completion))
            usage.num_completion_tokens += len(completion.token_ids)
        self._record(route, usage)
        return choices, usage.info()

    async def _events(
        self,
        route: str,
        req: p.SamplingRequest,
        prep: _Prepared,
        chunk_type: Callable[..., BaseModel],
        id_prefix: str,
        to_choice: Callable[[CompletionOutput], BaseModel],
        opening: Sequence[BaseModel] = (),
    ) -> AsyncIterator[str]:
        """stream=true: a chunk per opening choice, then per choice and step (`to_choice` of its
        delta), the usage chunk when asked for, [DONE]; an error event ends the chunks."""
        chunk_id, created = p.random_id(id_prefix), int(time.time())
        usage = _Usage(prep.num_prompt_tokens, details=self.enable_prompt_tokens_details)
        continuous = _wants(req, "continuous_usage_stats")
        failed = False

        def chunk(choices: list[BaseModel], with_usage: bool) -> str:
            body = chunk_type(
                id=chunk_id,
                created=created,
                model=prep.model,
                choices=choices,
                usage=usage.info() if with_usage else None,
            )
            return sse(body)

        for choice in opening:
            yield chunk([choice], continuous)
        async for outputs in self._stream(route, prep, usage):
            if isinstance(outputs, str):  # an error event, the stream's last item
                yield outputs
                failed = True
                continue
            for completion in outputs:
                yield chunk([to_choice(completion)], continuous)
        if not failed and _wants(req, "include_usage"):
            yield chunk([], True)
        yield SSE_DONE

    async def _collect(
        self, stream: GenerationStream, usage: _Usage, n: int
    ) -> list[CompletionOutput]:
        """Each choice's final output, in choice order (cancelling aborts the requests)."""
        finals: dict[int, CompletionOutput] = {}
        try:
            async for outputs in stream:
                for out in outputs:
                    finals[out.outputs[0].index] = out.outputs[0]
                    usage.note(out, n)
        except BatchInputError as e:  # the engine refused the parameters for this model
            raise ApiError(400, str(e)) from e
        finally:
            stream.abort()
        return [finals[i] for i in sorted(finals)]

    async def _stream(
        self, route: str, prep: _Prepared, usage: _Usage
    ) -> AsyncIterator[list[CompletionOutput] | str]:
        """The deltas of each step, or (last) an error event; counts tokens as they come."""
        stream: GenerationStream | None = None
        start = time.perf_counter()
        first = True
        try:
            stream = self.engine.generate(prep.inputs, stream=True)
            async for outputs in stream:
                if first and self.metrics is not None:
                    self.metrics.time_to_first_token.labels(route).observe(
                        time.perf_counter() - start
                    )
                first = False
                for out in outputs:
                    usage.note(out, prep.n)
                deltas = [out.outputs[0] for out in outputs]
                usage.num_completion_tokens += sum(len(d.token_ids) for d in deltas)
                yield deltas
        except Exception as exc:  # after the 200 went out: report in the stream itself
            yield error_event(exc, self.state)
        finally:
            if stream is not None:
                stream.abort()  # nothing if it ended; a client gone → abort in the engine
            self._record(route, usage)

    def _record(self, route: str, usage: _Usage) -> None:
        if self.metrics is None:
            return
        self.metrics.prompt_tokens.labels(route).inc(usage.num_prompt_tokens)
        self.metrics.generation_tokens.labels(route).inc(usage.num_completion_tokens)


# ---------------------------------------------------------------------- helpers


def _wants(req: p.SamplingRequest, option: str) -> bool:
    return bool(req.stream_options is not None and getattr(req.stream_options, option))
