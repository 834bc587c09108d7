"""Prometheus metrics of the server (prometheus_client), on a registry of its own per app.

Names follow vLLM's `vllm:` style with a `tidepool:` prefix:

    tidepool:http_requests_total{route,status}          every answered HTTP request
    tidepool:http_request_duration_seconds{route}       latency histogram, per route
    tidepool:prompt_tokens_total{route}                 tokens the engine computed for each route
    tidepool:generation_tokens_total{route}             tokens generated (completions, chat)
    tidepool:time_to_first_token_seconds{route}         streamed generation: request → first text
    tidepool:num_requests_waiting                       requests queued in the scheduler
    tidepool:num_requests_unfinished                    requests in the engine (waiting or running)
    tidepool:num_requests_running                       requests holding KV blocks (decoders)
    tidepool:step_num_requests / step_num_tokens / step_duration_seconds   per engine step
    tidepool:engine_steps_total, engine_step_failures_total, requests_aborted_total
    tidepool:shared_work_cache_hits_total / cache_misses_total / cache_evictions_total
    tidepool:shared_work_shared_total / computed_total    pooling inputs joined / sent to the engine
    tidepool:shared_work_cache_entries                  results held by --embedding-cache-size
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidepool.engine.async_engine import AsyncEngine, StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time (the engine thread writes them)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield GaugeMetricFamily(
            "tidepool:num_requests_waiting",
            "Requests queued in the scheduler, not yet computed (sampled between engine steps).",
            value=stats.num_waiting_requests,
        )
        yield GaugeMetricFamily(
            "tidepool:num_requests_unfinished",
            "Requests handed to the engine and not finished (waiting or in the running step).",
            value=stats.num_unfinished_requests,
        )
        yield GaugeMetricFamily(
            "tidepool:num_requests_running",
            "Requests running in the scheduler, holding KV-cache blocks (decoders; sampled "
            "between engine steps).",
            value=stats.num_running_requests,
        )
        counters = (
            ("tidepool:engine_steps", "Engine steps run.", stats.num_steps),
            ("tidepool:engine_step_failures", "Engine steps that raised.", stats.num_failed_steps),
            (
                "tidepool:requests_aborted",
                "Engine requests aborted because their client went away.",
                stats.num_aborted_requests,
            ),
            (
                "tidepool:requests_finished",
                "Engine requests finished (one per input).",
                stats.num_finished_requests,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield from _shared_work_metrics(self.engine)


def _shared_work_metrics(engine: AsyncEngine) -> Iterator[Metric]:
    """Counted per pooling input (engine/shared_work.py), on the event loop."""
    shared = engine.shared_work
    stats = shared.stats
    counters = (
        ("cache_hits", "Pooling inputs answered from the result cache.", stats.num_cache_hits),
        (
            "cache_misses",
            "Pooling inputs looked up in the result cache and not found.",
            stats.num_cache_misses,
        ),
        (
            "cache_evictions",
            "Result cache entries dropped at --embedding-cache-size (least recently used).",
            stats.num_cache_evictions,
        ),
        (
            "shared",
            "Pooling inputs that joined an identical one waiting or running (computed once).",
            stats.num_shared,
        ),
        ("computed", "Pooling inputs sent to the engine.", stats.num_computed),
    )
    for name, doc, value in counters:
        yield CounterMetricFamily(f"tidepool:shared_work_{name}", doc, value=value)
    yield GaugeMetricFamily(
        "tidepool:shared_work_cache_entries",
        "Results held in the result cache.",
        value=shared.num_cached,
    )


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        # The `*_created` timestamp series double the output and no dashboard reads them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "tidepool:http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "tidepool:http_request_duration_seconds",
            "Time from receiving a request to the end of its response, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tidepool:prompt_tokens",
            "Prompt tokens computed, by route.",
            ["route"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "tidepool:generation_tokens",
            "Tokens generated, by route (a stream cut short counts what it generated).",
            ["route"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "tidepool:time_to_first_token_seconds",
            "Streamed generation: from handing the request to the engine to its first text.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.step_num_requests = Histogram(
            "tidepool:step_num_requests",
            "Requests per engine step (dynamic batching across clients).",
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.step_num_tokens = Histogram(
            "tidepool:step_num_tokens",
            "Tokens per engine step.",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "tidepool:step_duration_seconds",
            "Duration of one engine step.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))

    def on_step(self, record: StepRecord) -> None:
        """Called on the engine thread after each step (prometheus_client is thread-safe)."""
        self.step_num_requests.observe(record.num_requests)
        self.step_num_tokens.observe(record.num_tokens)
        self.step_seconds.observe(record.seconds)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, str(status)).inc()
        self.http_latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
