"""The server's engine: one EngineCore, driven by one background thread, shared by many callers.

    event loop (one coroutine per HTTP request)          engine thread (the only one to touch
    ─────────────────────────────────────────            EngineCore)
    encode(prompts)                                      ─────────────────────────────────────
      tokenize ── tokenizer thread (run_in_executor)
      inbox.put(_Submit(group)) ──────────────────────▶  add_request × n
      await group.future                                 step(): the requests of every caller
         ◀── call_soon_threadsafe(a step's answers) ────  that arrived meanwhile share the step
      cancelled (client gone) → inbox.put(_Abort) ────▶  abort_request × (unfinished of n)

Dynamic batching needs no timer: while a step runs, new requests queue in the inbox, and the next
step takes all of them (up to the scheduler's token and sequence budgets).

Generating requests stream: `generate()` returns a GenerationStream, an async iterator over the
RequestOutputs each step produced for the caller. The engine thread runs the OutputProcessor
(incremental detokenization, stop strings) right after each step, stops a request in the scheduler
as soon as a stop string ends it, and hands the caller one list per step (one
`call_soon_threadsafe` per caller and step, not per token):

    engine thread: LLMEngine.step() → EngineCoreOutputs → OutputProcessor → deltas ──▶ the
                                        stop string → stop_request   caller's asyncio.Queue
                                                                     (one put per step)

Pooling requests keep their single-future path (a caller's future resolves when its last
request finished).

Admission: with a TokenBudget (`set_token_budget`) each call reserves its prompt tokens after
tokenization and gives them back when it ends, however it ends (finished, failed, cancelled: its
requests aborted, their KV blocks freed; a stream closed). The budget refuses; the engine counts.

Stepping, routing and failure handling are the engine driver's (engine/llm_engine.py): each
caller's group is a sink of the driver. This module adds the thread, the inbox and the futures.
Failure isolation: a request the engine rejects fails its caller alone; a step that raises fails
only the callers whose requests were in that step, and the loop goes on with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tidepool.checkpoint.loader import DEFAULT_MODEL
from tidepool.checkpoint.siglip_tokenizer import load_tokenizer
from tidepool.config import EngineConfig, ModelConfig
from tidepool.engine.args import build_engine_config
from tidepool.engine.chunked import combine, expand, has_chunks
from tidepool.engine.engine_core import EngineCore
from tidepool.engine.generate_inputs import eos_token_ids
from tidepool.engine.generation_stream import GenerationInput, GenerationStream, StreamGroup
from tidepool.engine.input_processor import InputProcessor
from tidepool.engine.llm_engine import (
    EngineClosedError,
    EngineStepError,
    LLMEngine,
    StepRecord,
)
from tidepool.engine.pooling_future import PoolingGroup, PoolingSubmission, Resolution, deliver
from tidepool.engine.shared_work import SharedWork, SharedWorkOptions
from tidepool.outputs import BatchInputError, PoolingRequestOutput, RequestError
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request
from tidepool.utils.lists import filled

__all__ = [
    "AsyncEngine",
    "AsyncEngineStats",
    "EngineClosedError",
    "EngineStepError",
    "StepRecord",
    "TokenBudget",
]

logger = logging.getLogger("tidepool")

T = TypeVar("T")

# Threads that tokenize prompts (see AsyncEngine.__init__): enough that a request with huge texts
# (bounded by the prefix tokenizer, but still up to ~1 s for 30 MB) leaves others a free worker.
INPUT_WORKERS = 4


class TokenBudget(Protocol):
    """Admission of engine calls by their prompt tokens (the server's --max-queued-tokens)."""

    def reserve(self, num_tokens: int) -> None:
        """Take `num_tokens` for a call about to be handed to the engine, or raise to refuse it
        (nothing of it runs). Called on the event loop."""

    def release(self, num_tokens: int) -> None:
        """Give back what one successful `reserve` took; called once, when the call ends."""


@dataclass
class AsyncEngineStats:
    """Counters written by the engine thread only; other threads read them as samples."""

    num_steps: int = 0
    num_failed_steps: int = 0
    num_finished_requests: int = 0
    num_aborted_requests: int = 0
    num_unfinished_requests: int = 0
    """Requests handed to the engine thread and not finished (waiting or in the running step)."""
    num_waiting_requests: int = 0
    """Requests in the scheduler's queue, sampled between steps."""
    num_running_requests: int = 0
    """Requests holding KV-cache blocks in the scheduler (decoders), sampled between steps."""
    kv_cache_usage: float = 0.0  # share of KV-cache blocks in use (0: an encoder), sampled


@dataclass
class _Submit:
    group: PoolingGroup | StreamGroup


@dataclass
class _Abort:
    group: PoolingGroup | StreamGroup


@dataclass
class _Stop:
    drain: bool = True
    """True: finish every request already handed over, then stop. False: fail them and stop."""


_Command = _Submit | _Abort | _Stop


class AsyncEngine:
    """Async front of one EngineCore; safe to call from many coroutines of one event loop."""

    def __init__(self, config: EngineConfig, shared_work: SharedWorkOptions | None = None) -> None:
        self.config = config
        # Pooling requests (encode, encode_pairs) go through it: identical inputs computed once.
        self.shared_work = SharedWork(self._submit_pooling, shared_work or SharedWorkOptions())
        self.input_processor = InputProcessor(config.model)
        detokenizer = None
        self.eos_token_ids: tuple[int, ...] = ()
        if config.model.runner_type == "generate":
            # The engine thread detokenizes with a tokenizer of its own: the tokenizer thread's
            # instance may be changing its truncation settings at the same moment.
            detokenizer = load_tokenizer(config.model.tokenizer_source)
            self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self._engine = LLMEngine(
            config, detokenizer=detokenizer, multi_vector=self.input_processor.multi_vector
        )
        """Touched by the engine thread only (after start())."""
        self._stop: _Stop | None = None
        """The stop command the engine thread got (engine thread only)."""
        self.stats = AsyncEngineStats()
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._outbox: list[Resolution] = []  # a step's pooling answers, delivered together
        # Prompts are tokenized on INPUT_WORKERS threads: the InputProcessor holds no shared
        # mutable state, and the Rust tokenizer releases the GIL, so one request's long texts do
        # not hold up the next. The Hugging Face tokenizer itself (/tokenize, chat templates,
        # decoding) changes its truncation settings on each call: one thread of its own.
        self._input_pool = ThreadPoolExecutor(INPUT_WORKERS, thread_name_prefix="tidepool-input")
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tidepool-tokenizer")
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._num_admitted = 0
        """Calls between admission and their answer (event-loop thread only)."""
        self._dead: BaseException | None = None
        self._token_budget: TokenBudget | None = None

    @classmethod
    def from_args(
        cls,
        model: str | None = None,
        shared_work: SharedWorkOptions | None = None,
        **engine_args: Any,
    ) -> AsyncEngine:
        """Build the engine like `LLM(model, **engine_args)` does."""
        return cls(build_engine_config(model or DEFAULT_MODEL, **engine_args), shared_work)

    # ------------------------------------------------------------------ info

    @property
    def _core(self) -> EngineCore:
        return self._engine.core

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        # Immutable after construction; reading it from another thread is safe.
        return self._core.model_runner.pooler.supported_tasks()

    @property
    def can_generate(self) -> bool:
        return self._engine.can_generate

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call `listener` on the engine thread after each step (metrics); add before start()."""
        self._step_listeners.append(listener)

    def set_token_budget(self, budget: TokenBudget | None) -> None:
        self._token_budget = budget  # several engines may share one

    def _reserve_tokens(self, requests: Sequence[Request]) -> int:
        """Reserve the requests' prompt tokens (the budget may refuse: it raises); how many."""
        if self._token_budget is None:
            return 0
        num_tokens = sum(r.num_prompt_tokens for r in requests)
        self._token_budget.reserve(num_tokens)
        return num_tokens

    def _release_tokens(self, num_tokens: int) -> None:
        if self._token_budget is not None:
            self._token_budget.release(num_tokens)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run_loop, name="tidepool-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, finish those in flight (at most `timeout_s`), stop the thread.

        In flight = every call admitted before shutdown began, including one still tokenizing.
        """
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        # Polled, not an asyncio.Event: the engine may serve several event loops in turn.
        while self._num_admitted and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.01)
        if self._thread is not None:
            drained = not self._num_admitted
            if not drained:
                logger.warning("engine did not drain in %.0f s; failing what is left", timeout_s)
            self._inbox.put(_Stop(drain=drained))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests

    async def run_in_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the thread that owns the Hugging Face tokenizer (`self.tokenizer`):
        its calls never block the event loop, and never run two at once."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, fn, *args)

    async def _run_in_input_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an InputProcessor call on one of the input workers (safe to run concurrently)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._input_pool, fn, *args)

    async def encode(
        self, prompts: Sequence[Any], params: Sequence[PoolingParams]
    ) -> list[PoolingRequestOutput]:
        """One output per prompt, in order. Invalid prompts raise BatchInputError (none run)."""
        with self._admit():
            items = await self._run_in_input_worker(self.input_processor.process, prompts, params)
            return await self._run_items(_requests_or_raise(items))

    async def encode_pairs(
        self, pairs: Sequence[tuple[Any, Any]], params: Sequence[PoolingParams]
    ) -> list[PoolingRequestOutput]:
        """Cross-encoder pairs, like `encode`."""
        with self._admit():
            items = await self._run_in_input_worker(
                self.input_processor.process_pairs, pairs, params
            )
            return await self._run_items(_requests_or_raise(items))

    async def run(self, requests: list[Request]) -> list[PoolingRequestOutput]:
        """Run tokenized requests; cancelling the awaiting task aborts them in the engine."""
        with self._admit():
            return await self._run_admitted(requests)

    async def process_generate(
        self,
        prompts: Sequence[Any],
        params: Sequence[SamplingParams],
        add_special_tokens: bool = True,
    ) -> list[Request]:
        """Tokenize and check generating prompts (on the tokenizer thread): one Request per
        prompt, in order; invalid prompts raise BatchInputError."""
        with self._admit():
            items = await self._run_in_input_worker(
                self.input_processor.process_generate,
                prompts,
                params,
                self.eos_token_ids,
                add_special_tokens,
            )
        requests = _requests_or_raise(items)
        # Refuse now what generate() would refuse, while the answer can still be a status (a
        # stream's 200 goes out before generate() runs); generate() reserves for real.
        self._release_tokens(self._reserve_tokens(requests))
        return requests

    def generate(self, inputs: list[GenerationInput], stream: bool = True) -> GenerationStream:
        """Hand generating requests to the engine; see GenerationStream. `stream`: a delta per
        request and step that adds text; False: each request's final output only."""
        if not self.can_generate:
            raise ValueError(f"this {self.model_config.task} model does not generate text")
        if not inputs:
            raise ValueError("generate() needs at least one request")
        self._check_accepting()
        group = StreamGroup(list(inputs), asyncio.get_running_loop(), stream)
        num_tokens = self._reserve_tokens(group.requests)
        self._num_admitted += 1  # until the stream ends
        self._inbox.put(_Submit(group))

        def release() -> None:  # once: GenerationStream calls it when the stream ends
            self._num_admitted -= 1
            self._release_tokens(num_tokens)

        return GenerationStream(group, lambda: self._inbox.put(_Abort(group)), release)

    @contextlib.contextmanager
    def _admit(self) -> Iterator[None]:
        """Count the call as in flight (shutdown waits for it); refuse it when closing."""
        self._check_accepting()
        self._num_admitted += 1
        try:
            yield
        finally:
            self._num_admitted -= 1

    async def _run_items(self, items: list[Any]) -> list[PoolingRequestOutput]:
        """Requests, and long inputs run in chunks whose outputs are combined (chunked.py)."""
        if not has_chunks(items):
            return await self._run_pooling(items)
        expansion = expand(items)
        # The items passed _requests_or_raise: every flat item is a Request, every output there.
        requests = [r for r in expansion.flat if isinstance(r, Request)]
        assert len(requests) == len(expansion.flat)
        outputs = await self._run_pooling(requests)
        return filled(combine(expansion, outputs, [], self.model_config)[0])

    async def _run_pooling(self, requests: list[Request]) -> list[PoolingRequestOutput]:
        if not self.shared_work.options.enabled:
            return await self._run_admitted(requests)
        return await self.shared_work.run(requests)

    async def _run_admitted(self, requests: list[Request]) -> list[PoolingRequestOutput]:
        if not requests:
            return []
        submission = self._submit_pooling(requests)
        try:
            return await submission.future
        except asyncio.CancelledError:  # client gone or deadline passed: free its blocks
            submission.cancel()
            raise

    def _submit_pooling(self, requests: list[Request]) -> PoolingSubmission:
        """Hand pooling requests to the engine thread now (no task, no await): their prompt
        tokens are reserved (the budget may refuse: it raises, and nothing is handed over) until
        the submission's future is done, however it ends."""
        if self._dead is not None:
            raise EngineClosedError(f"the engine has stopped after an internal error: {self._dead}")
        num_tokens = self._reserve_tokens(requests)
        group = PoolingGroup(requests, asyncio.get_running_loop(), self._outbox)
        if num_tokens:
            group.future.add_done_callback(lambda _: self._release_tokens(num_tokens))
        self._inbox.put(_Submit(group))
        return PoolingSubmission(group, lambda: self._inbox.put(_Abort(group)))

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineClosedError(f"the engine has stopped after an internal error: {self._dead}")
        if not self._accepting or self._thread is None:
            raise EngineClosedError(
                "the engine is not accepting requests (not started or shut down)"
            )

    # ------------------------------------------------------------------ engine thread

    def _run_loop(self) -> None:
        engine = self._engine
        try:
            while True:
                self._handle_commands(block=not engine.has_unfinished_requests())
                self._publish()
                if self._stop is not None and (
                    not self._stop.drain or not engine.has_unfinished_requests()
                ):
                    break
                if engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as exc:  # a bug in the loop itself: fail everyone, refuse new work
            logger.exception("the engine loop died")
            self._dead = exc
            engine.fail_all(f"the engine loop died: {exc!r}", EngineStepError)
            self._fail_inbox(exc)
            return
        engine.fail_all("the engine stopped before finishing the request")
        self._fail_inbox(EngineClosedError("the engine has stopped"))

    def _handle_commands(self, block: bool) -> None:
        """Apply every queued command; wait for one first when there is nothing to compute."""
        while True:
            try:
                command = self._inbox.get(block=block and self._stop is None)
            except queue.Empty:
                return
            block = False
            if isinstance(command, _Submit):
                self._add_group(command.group)
            elif isinstance(command, _Abort):
                self.stats.num_aborted_requests += self._drop_group(command.group)
            elif self._stop is None or not command.drain:
                self._stop = command

    def _add_group(self, group: PoolingGroup | StreamGroup) -> None:
        if self._stop is not None:
            group.fail(EngineClosedError("the engine is shutting down"))
            return
        for index, request in enumerate(group.requests):
            labels = group.inputs[index] if isinstance(group, StreamGroup) else None
            try:
                self._engine.add_request(
                    request,
                    group,
                    prompt=labels.prompt if labels is not None else None,
                    index=labels.index if labels is not None else 0,
                    stream=isinstance(group, StreamGroup) and group.stream,
                )
            except Exception as exc:  # bad parameters for this model: this caller alone fails
                self._drop_group(group)
                group.fail(BatchInputError([RequestError(index, str(exc))]))
                return

    def _drop_group(self, group: PoolingGroup | StreamGroup) -> int:
        """Abort the group's unfinished requests in the engine; returns how many there were."""
        return sum(self._engine.abort_request(r.request_id) for r in group.requests)

    def _step(self) -> None:
        record = self._engine.step()
        if record.failed:
            self.stats.num_failed_steps += 1
            return
        self.stats.num_steps += 1
        self.stats.num_finished_requests += record.num_finished
        if not record.num_requests:
            return
        for listener in self._step_listeners:
            try:
                listener(record)
            except Exception:  # metrics must never stop the engine
                logger.exception("step listener failed")

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                deliver(self._outbox)
                return
            if isinstance(command, _Submit):
                command.group.fail(EngineClosedError(str(exc)))

    def _publish(self) -> None:
        """Deliver the answers of what just ran, then sample the counters."""
        deliver(self._outbox)
        scheduler = self._engine.core.scheduler
        self.stats.num_unfinished_requests = self._engine.num_unfinished_requests
        self.stats.num_waiting_requests = scheduler.num_waiting
        self.stats.num_running_requests = scheduler.num_running
        kv = self._engine.core.kv_cache_manager
        self.stats.kv_cache_usage = kv.usage if kv is not None else 0.0


def _requests_or_raise(items: list[Any]) -> list[Any]:
    errors = [item for item in items if isinstance(item, RequestError)]
    if errors:
        raise BatchInputError(errors)
    return items
