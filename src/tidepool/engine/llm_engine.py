"""The engine driver: the one loop that steps EngineCore and routes each request's outputs.

    caller (LLM, AsyncEngine)         LLMEngine                                 EngineCore
    add_request(request, sink) ─────▶ route request_id → sink ────────────────▶ add_request
    step() ─────────────────────────▶ core.step() ────────────────────────────▶ schedule → execute
                                                                                 → update
      sink.add_output(out) ◀──────── PoolingCoreOutput → PoolingRequestOutput
                           ◀──────── EngineCoreOutput → OutputProcessor → RequestOutput
                                       (detokenize; a stop string → core.stop_request)
      sink.flush()         ◀──────── once per sink and step that gave it outputs
      sink.fail(error)     ◀──────── the step raised: its requests' callers fail, and the
                                       callers' other requests are aborted; the engine goes on
    abort_request(id) ──────────────▶ core and output processor forget the request

A sink is one caller's receiver: the offline `LLM` collects final outputs (`run_batch`), the
server's AsyncEngine resolves a future (pooling) or feeds a stream (generation). Every unfinished
request has exactly one route, so every output has a caller.

Only this driver calls `EngineCore.step()`. It is not thread-safe: one thread drives it (the
offline caller's, or the AsyncEngine's engine thread).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from tidepool.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tidepool.core.outputs import EngineCoreOutput, PoolingCoreOutput
from tidepool.engine.engine_core import EngineCore, StepFailedError
from tidepool.engine.generation_stream import GenerationInput
from tidepool.engine.multi_vector import MultiVectorInputs
from tidepool.engine.output_processor import OutputProcessor
from tidepool.engine.prompts import is_query
from tidepool.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from tidepool.request import Request

logger = logging.getLogger("tidepool")

Output = PoolingRequestOutput | RequestOutput
OutputT_contra = TypeVar("OutputT_contra", contravariant=True)


class OutputSink(Protocol[OutputT_contra]):
    """Where the outputs of one caller's requests go (called on the driver's thread); a sink
    takes the outputs of the kind of requests it routes (pooled or generated)."""

    def add_output(self, out: OutputT_contra) -> None:
        """An output of one of its requests: a pooled result, a generated request's final
        output, or (streamed) a delta; `out.finished` marks the request's last one."""

    def flush(self) -> None:
        """The end of a step in which it got outputs."""

    def fail(self, exc: BaseException) -> None:
        """Its requests get no more outputs: the driver has aborted those still unfinished."""


class EngineStepError(RuntimeError):
    """The engine step that computed one of this caller's requests raised (the cause is chained)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down or has stopped: no new requests are taken, and requests it
    stops before their end fail with this (the server answers 503: try again elsewhere)."""


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did (the driver's step result; handed to the server's metrics)."""

    num_requests: int
    """Per-request results of the step: pooled outputs and sampled tokens."""
    num_tokens: int
    """Tokens the step computed for them (pooling-only steps: the finished prompts' tokens)."""
    seconds: float
    """Wall time of the step, routing included."""
    num_finished: int = 0
    """Requests that finished in the step."""
    failed: bool = False
    """The step raised; its requests' callers were failed."""


def apply_num_threads(num_threads: int | None) -> None:
    """torch's intra-op threads: `num_threads`, else the cores this process may run on (torch's
    own default counts the machine's cores, which oversubscribes a process pinned to fewer, e.g.
    in a container). Applied when an engine starts, never while building its configuration."""
    if num_threads is None and hasattr(os, "sched_getaffinity"):
        num_threads = min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    if num_threads is not None and num_threads != torch.get_num_threads():
        torch.set_num_threads(num_threads)


@dataclass(frozen=True)
class VllmConfigView:
    """The engine's configuration under vLLM's VllmConfig names (read-only)."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig


class LLMEngine:
    """EngineCore plus the output processor, routing outputs to their callers' sinks."""

    def __init__(
        self,
        config: EngineConfig,
        detokenizer: Any = None,
        multi_vector: MultiVectorInputs | None = None,
    ) -> None:
        """`detokenizer`: the tokenizer the output processor decodes generated tokens with.
        `multi_vector`: a ColBERT model's rules (the input processor's): documents' outputs
        drop the vectors of skiplist tokens."""
        apply_num_threads(config.num_threads)
        self.config = config
        self.core = EngineCore(config)
        self.output_processor = OutputProcessor(detokenizer)
        self._sink_of: dict[str, OutputSink[Any]] = {}
        """request_id → its caller's sink, for every unfinished request."""
        self._multi_vector = multi_vector
        self._documents: set[str] = set()
        """Unfinished ColBERT document requests (their skiplist rows are dropped)."""

    @property
    def vllm_config(self) -> VllmConfigView:
        """vLLM's `llm.llm_engine.vllm_config` (its `model_config.hf_config` is how vLLM's
        examples read `id2label`): tidepool's frozen configs under vLLM's attribute names."""
        return VllmConfigView(self.config.model, self.config.scheduler, self.config.cache)

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's `llm.llm_engine.model_config`."""
        return self.config.model

    @property
    def can_generate(self) -> bool:
        return self.core.model_runner.sampler is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._sink_of)

    def has_unfinished_requests(self) -> bool:
        return bool(self._sink_of)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request: Request,
        sink: OutputSink[Any],
        *,
        prompt: str | None = None,
        index: int = 0,
        stream: bool = False,
    ) -> None:
        """Route the request's outputs to `sink`. ValueError: the engine refused the request
        (nothing was added). `prompt`, `index`, `stream`: a generating request's output labels
        (RequestOutput.prompt, CompletionOutput.index) and whether it gets a delta per step."""
        self.core.add_request(request)
        self._sink_of[request.request_id] = sink
        params = request.pooling_params
        if (
            self._multi_vector is not None
            and params is not None
            and params.task == "token_embed"
            and not is_query(self.config.model, params.prompt_name)
        ):
            self._documents.add(request.request_id)
        if request.sampling_params is not None:
            self.output_processor.add_request(
                request.request_id,
                prompt,
                request.prompt_token_ids,
                request.sampling_params,
                index=index,
                stream=stream,
            )

    def abort_request(self, request_id: str) -> bool:
        """Forget an unfinished request everywhere; False if it is unknown or already finished."""
        self._documents.discard(request_id)
        if self._sink_of.pop(request_id, None) is None:
            return False
        self.core.abort_request(request_id)
        self.output_processor.abort_request(request_id)
        return True

    def fail_all(self, why: str, error_type: type[RuntimeError] = EngineClosedError) -> None:
        """Fail every caller with unfinished requests (the engine stops) and abort them."""
        self._fail_sinks(dict.fromkeys(self._sink_of.values()), why, None, error_type)

    # ------------------------------------------------------------------ step

    def step(self) -> StepRecord:
        """One engine step, its outputs routed. A step that raises fails the callers of its
        requests (logged); other exceptions (a bug outside the step) propagate."""
        start = time.perf_counter()
        num_scheduled_before = self.core.stats.num_scheduled_tokens
        try:
            core_outputs = self.core.step()
        except StepFailedError as exc:
            logger.exception("engine step failed; failing the requests of that step only")
            failed = self._sink_of.keys() & set(exc.request_ids)
            sinks = dict.fromkeys(self._sink_of[request_id] for request_id in failed)
            self._fail_sinks(sinks, str(exc), exc.__cause__)
            return StepRecord(0, 0, time.perf_counter() - start, failed=True)
        touched: dict[OutputSink[Any], None] = {}
        generated: list[EngineCoreOutput] = []
        num_pooled_tokens = 0
        for out in core_outputs:
            if isinstance(out, PoolingCoreOutput):
                sink = self._sink_of.pop(out.request_id)
                sink.add_output(
                    PoolingRequestOutput(
                        out.request_id,
                        out.prompt_token_ids,
                        PoolingOutput(self._finish(out)),
                        num_cached_tokens=out.num_cached_tokens,
                    )
                )
                touched[sink] = None
                num_pooled_tokens += len(out.prompt_token_ids)
            else:
                generated.append(out)
        num_finished = len(core_outputs) - len(generated)
        num_tokens = num_pooled_tokens
        if generated:
            num_finished += self._route_generated(generated, touched)
            # Decode steps: every scheduled token, prompt chunks included.
            num_tokens = self.core.stats.num_scheduled_tokens - num_scheduled_before
        for sink in touched:
            sink.flush()
        seconds = time.perf_counter() - start
        return StepRecord(len(core_outputs), num_tokens, seconds, num_finished)

    def _finish(self, out: PoolingCoreOutput) -> Any:
        """A pooled output as its caller gets it: a ColBERT document without the vectors of
        its skiplist tokens (model_loader/colbert.py)."""
        if out.request_id not in self._documents:
            return out.data
        self._documents.discard(out.request_id)
        kept = self._multi_vector.kept_rows(out.prompt_token_ids)  # type: ignore[union-attr]
        return out.data if kept is None else out.data[kept]

    def _route_generated(
        self, core_outputs: list[EngineCoreOutput], touched: dict[OutputSink[Any], None]
    ) -> int:
        """Detokenize the step's tokens, stop the requests a stop string ended (their blocks are
        freed before the next step), hand the outputs on; returns how many finished."""
        outputs, to_stop = self.output_processor.process(core_outputs)
        for request_id, stop_str in to_stop:
            self.core.stop_request(request_id, stop_str)
        num_finished = 0
        for out in outputs:
            if out.finished:
                sink = self._sink_of.pop(out.request_id)
                num_finished += 1
            else:
                sink = self._sink_of[out.request_id]
            sink.add_output(out)
            touched[sink] = None
        return num_finished

    def _fail_sinks(
        self,
        sinks: dict[OutputSink[Any], None],
        why: str,
        cause: BaseException | None,
        error_type: type[RuntimeError] = EngineStepError,
    ) -> None:
        # A caller's other requests are useless once one failed: abort them too.
        for request_id in [r for r, sink in self._sink_of.items() if sink in sinks]:
            self.abort_request(request_id)
        for sink in sinks:
            error = error_type(why)
            error.__cause__ = cause
            sink.fail(error)

    # ------------------------------------------------------------------ offline

    def run_batch(
        self, requests: Sequence[Request | GenerationInput], use_tqdm: bool = False
    ) -> tuple[list[Output | None], list[str | None]]:
        """Run requests to their end (the offline API). Per request, in order: its final output,
        and why the engine refused it (None when accepted). A failed step raises EngineStepError;
        any exception aborts this batch's unfinished requests first."""
        collector = _BatchCollector(len(requests))
        rejected: list[str | None] = [None] * len(requests)
        for slot, item in enumerate(requests):
            labels = item if isinstance(item, GenerationInput) else GenerationInput(item)
            try:
                self.add_request(
                    labels.request, collector, prompt=labels.prompt, index=labels.index
                )
            except ValueError as exc:
                rejected[slot] = str(exc)
                continue
            collector.slot_of[labels.request.request_id] = slot
        collector.start_progress(use_tqdm)
        try:
            while collector.num_unfinished and collector.error is None:
                self.step()
        except BaseException:
            for request_id in collector.slot_of:
                self.abort_request(request_id)
            raise
        finally:
            collector.close_progress()
        if collector.error is not None:
            raise collector.error
        return collector.results, rejected


class _BatchCollector:
    """The offline caller's sink: each request's final output, in the caller's order."""

    def __init__(self, num_requests: int) -> None:
        self.slot_of: dict[str, int] = {}
        """request_id → its place in the caller's list."""
        self.results: list[Output | None] = [None] * num_requests
        self.num_finished = 0
        self.error: BaseException | None = None
        self.pbar: Any = None

    @property
    def num_unfinished(self) -> int:
        return len(self.slot_of) - self.num_finished

    def start_progress(self, use_tqdm: bool) -> None:
        if use_tqdm and len(self.slot_of) > 1:
            from tqdm.auto import tqdm

            self.pbar = tqdm(total=len(self.slot_of), desc="Processed prompts", dynamic_ncols=True)

    def close_progress(self) -> None:
        if self.pbar is not None:
            self.pbar.close()

    def add_output(self, out: Output) -> None:
        self.results[self.slot_of[out.request_id]] = out
        self.num_finished += 1
        if self.pbar is not None:
            self.pbar.update(1)

    def flush(self) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        self.error = exc
