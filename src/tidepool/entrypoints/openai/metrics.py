"""Prometheus metrics of the server (prometheus_client), on a registry of its own per app.

Names follow vLLM's `vllm:` style with a `tidepool:` prefix:

    tidepool:http_requests_total{route,status}          every answered HTTP request
    tidepool:http_request_duration_seconds{route}       latency histogram, per route
    tidepool:prompt_tokens_total{route}                 tokens the engine computed for each route
    tidepool:generation_tokens_total{route}             tokens generated (completions, chat)
    tidepool:time_to_first_token_seconds{route}         streamed generation: request → first text
    tidepool:num_requests_in_flight                     HTTP requests holding an admission permit
    tidepool:num_queued_tokens                          prompt tokens admitted, not yet finished
    tidepool:requests_refused_total{reason}             429 / 413 of admission control (reason:
                                                        concurrency, queued_tokens, request_tokens)
    tidepool:requests_timed_out_total                   aborted at --request-timeout (503)
  per model (label `model`: its first served name):
    tidepool:num_requests_waiting                       requests queued in the scheduler
    tidepool:num_requests_unfinished                    requests in the engine (waiting or running)
    tidepool:num_requests_running                       requests holding KV blocks (decoders)
    tidepool:kv_cache_usage                             fraction of KV-cache blocks in use (decoders)
    tidepool:step_num_requests / step_num_tokens / step_duration_seconds   per engine step
    tidepool:engine_steps_total, engine_step_failures_total, requests_aborted_total,
    tidepool:requests_finished_total
    tidepool:shared_work_cache_hits_total / cache_misses_total / cache_evictions_total
    tidepool:shared_work_shared_total / computed_total    pooling inputs joined / sent to the engine
    tidepool:shared_work_cache_entries                  results held in the result cache
    tidepool:shared_work_cache_bytes / cache_max_bytes  their bytes, and the cache's byte bound
  and, per model (label `model_name`, as vLLM's), under vLLM's own names so its dashboards work:
    vllm:num_requests_running / num_requests_waiting / kv_cache_usage_perc      gauges
    vllm:prompt_tokens_total / generation_tokens_total / request_success_total   counters
    vllm:num_preemptions_total / prefix_cache_queries_total / prefix_cache_hits_total
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
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
    """Reads each engine's counters at scrape time (the engine threads write them)."""

    def __init__(self, engines: Mapping[str, AsyncEngine]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        gauges = (
            (
                "tidepool:num_requests_waiting",
                "Requests queued in the scheduler, not yet computed (sampled between engine "
                "steps).",
                "num_waiting_requests",
            ),
            (
                "tidepool:num_requests_unfinished",
                "Requests handed to the engine and not finished (waiting or in the running step).",
                "num_unfinished_requests",
            ),
            (
                "tidepool:num_requests_running",
                "Requests running in the scheduler, holding KV-cache blocks (decoders; sampled "
                "between engine steps).",
                "num_running_requests",
            ),
            (
                "tidepool:kv_cache_usage",
                "Fraction of KV-cache blocks in use (decoders; sampled between engine steps).",
                "kv_cache_usage",
            ),
        )
        counters = (
            ("tidepool:engine_steps", "Engine steps run.", "num_steps"),
            ("tidepool:engine_step_failures", "Engine steps that raised.", "num_failed_steps"),
            (
                "tidepool:requests_aborted",
                "Engine requests aborted: their client went away or their deadline passed.",
                "num_aborted_requests",
            ),
            (
                "tidepool:requests_finished",
                "Engine requests finished (one per input).",
                "num_finished_requests",
            ),
        )
        for family_type, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, attribute in table:
                family = family_type(name, doc, labels=["model"])
                for model, engine in self.engines.items():
                    family.add_metric([model], getattr(engine.stats, attribute))
                yield family
        yield from _shared_work_metrics(self.engines)


def _shared_work_metrics(engines: dict[str, AsyncEngine]) -> Iterator[Metric]:
    """Counted per pooling input (engine/shared_work.py), on the event loop; labelled by model."""
    counters = (
        ("cache_hits", "Pooling inputs answered from the result cache.", "num_cache_hits"),
        (
            "cache_misses",
            "Pooling inputs looked up in the result cache and not found.",
            "num_cache_misses",
        ),
        (
            "cache_evictions",
            "Result cache entries dropped at a bound (bytes or entries; least recently used).",
            "num_cache_evictions",
        ),
        (
            "shared",
            "Pooling inputs that joined an identical one waiting or running (computed once).",
            "num_shared",
        ),
        ("computed", "Pooling inputs sent to the engine.", "num_computed"),
    )
    for name, doc, attribute in counters:
        family = CounterMetricFamily(f"tidepool:shared_work_{name}", doc, labels=["model"])
        for model, engine in engines.items():
            family.add_metric([model], getattr(engine.shared_work.stats, attribute))
        yield family
    entries = GaugeMetricFamily(
        "tidepool:shared_work_cache_entries", "Results held in the result cache.", labels=["model"]
    )
    size = GaugeMetricFamily(
        "tidepool:shared_work_cache_bytes",
        "Bytes the result cache's entries take (tensors and keys), of its "
        "--embedding-cache-bytes bound.",
        labels=["model"],
    )
    bound = GaugeMetricFamily(
        "tidepool:shared_work_cache_max_bytes",
        "The result cache's byte bound (0: no cache).",
        labels=["model"],
    )
    for model, engine in engines.items():
        entries.add_metric([model], engine.shared_work.num_cached)
        size.add_metric([model], engine.shared_work.cached_bytes)
        bound.add_metric([model], engine.shared_work.options.max_cache_bytes)
    yield entries
    yield size
    yield bound


_VLLM_GAUGES = (
    ("vllm:num_requests_running", "Requests in model execution batches.", "num_requests_running"),
    ("vllm:num_requests_waiting", "Requests waiting to be processed.", "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 percent).", "kv_cache_usage"),
)
_VLLM_COUNTERS = (
    ("vllm:prompt_tokens", "Prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Generation tokens processed.", "generation_tokens"),
    ("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", "prefix_cache_hits"),
)


class _VllmCollector(Collector):
    """The engine's counters under vLLM's `vllm:` names and `model_name` label (read from each
    engine core's snapshot at scrape time: plain integers the engine thread writes)."""

    def __init__(self, engines: Mapping[str, AsyncEngine]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        snapshots = {model: engine._core.get_metrics() for model, engine in self.engines.items()}
        for family_type, table in (
            (GaugeMetricFamily, _VLLM_GAUGES),
            (CounterMetricFamily, _VLLM_COUNTERS),
        ):
            for name, doc, attribute in table:
                family = family_type(name, doc, labels=["model_name"])
                for model, snapshot in snapshots.items():
                    family.add_metric([model], getattr(snapshot, attribute))
                yield family
        success = CounterMetricFamily(
            "vllm:request_success",
            "Successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        for model, engine in self.engines.items():
            success.add_metric([model, "stop"], engine.stats.num_finished_requests)
        yield success


class ServerMetrics:
    def __init__(self, engines: AsyncEngine | Mapping[str, AsyncEngine]) -> None:
        """`engines`: each model's engine by its served name (one engine: labelled by its
        model argument)."""
        if isinstance(engines, AsyncEngine):
            engines = {engines.model_config.model: engines}
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
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.step_num_tokens = Histogram(
            "tidepool:step_num_tokens",
            "Tokens per engine step.",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "tidepool:step_duration_seconds",
            "Duration of one engine step.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._add_admission_metrics()
        self.registry.register(_EngineCollector(dict(engines)))
        self.registry.register(_VllmCollector(dict(engines)))
        for model, engine in engines.items():
            engine.add_step_listener(self._step_listener(model))

    def _add_admission_metrics(self) -> None:
        self.requests_in_flight = Gauge(
            "tidepool:num_requests_in_flight",
            "HTTP requests to engine routes holding an admission permit.",
            registry=self.registry,
        )
        self.queued_tokens = Gauge(
            "tidepool:num_queued_tokens",
            "Prompt tokens admitted to the engines and not finished (--max-queued-tokens).",
            registry=self.registry,
        )
        self.requests_refused = Counter(
            "tidepool:requests_refused",
            "Requests refused by admission control, by reason: concurrency (429), queued_tokens "
            "(429), request_tokens (413).",
            ["reason"],
            registry=self.registry,
        )
        self.requests_timed_out = Counter(
            "tidepool:requests_timed_out",
            "Requests aborted at their --request-timeout deadline (503).",
            registry=self.registry,
        )

    def _step_listener(self, model: str) -> Callable[[StepRecord], None]:
        """Called on the model's engine thread after each step (prometheus_client is
        thread-safe); the children are looked up once, not per step."""
        num_requests = self.step_num_requests.labels(model)
        num_tokens = self.step_num_tokens.labels(model)
        seconds = self.step_seconds.labels(model)

        def on_step(record: StepRecord) -> None:
            num_requests.observe(record.num_requests)
            num_tokens.observe(record.num_tokens)
            seconds.observe(record.seconds)

        return on_step

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, str(status)).inc()
        self.http_latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
