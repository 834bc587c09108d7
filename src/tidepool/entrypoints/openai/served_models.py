"""The models of one server: each its own AsyncEngine (and engine thread) and the services over
it; a request goes to the model its `model` field names.

    body.model ──▶ ServedModels.resolve ──▶ ServedModel(engine, serving, tokenization, generation)
      None / "" → the first model given (what a single-model server always did)
      unknown   → 404 in OpenAI's shape, listing the names served

TEI's routes have no `model` field: `?model=NAME` in the URL picks one (ours; TEI serves one model
per server), else the first model that serves the route's task (`serving_task`).

A route picks the service it needs from the resolved model (server.py's `engine_route`), so a new
route works for every model by naming its service once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidepool.engine.async_engine import AsyncEngine
from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.encodings import EmbeddingCalibration
from tidepool.entrypoints.openai.errors import ApiError, ServerState
from tidepool.entrypoints.openai.metrics import ServerMetrics
from tidepool.entrypoints.openai.serving import OpenAIServing, ServingLimits
from tidepool.entrypoints.openai.serving_cohere import CohereServing
from tidepool.entrypoints.openai.serving_generate import OpenAIServingGeneration
from tidepool.entrypoints.openai.serving_sparse import OpenAIServingSparse
from tidepool.entrypoints.openai.serving_tei import TeiServing
from tidepool.entrypoints.openai.serving_tokenize import OpenAIServingTokenization

logger = logging.getLogger("tidepool")


@dataclass(frozen=True)
class NamedEngine:
    """An engine and the names clients may put in `model` for it (the first is echoed back)."""

    engine: AsyncEngine
    names: tuple[str, ...]


@dataclass(frozen=True)
class ServedModel:
    """One model of the server and the services over its engine."""

    names: tuple[str, ...]
    """Its served names; the first labels its metrics and its /health entry."""
    engine: AsyncEngine
    serving: OpenAIServing
    tokenization: OpenAIServingTokenization
    generation: OpenAIServingGeneration
    sparse: OpenAIServingSparse
    cohere: CohereServing
    tei: TeiServing

    @property
    def name(self) -> str:
        return self.names[0]


class ServedModels:
    """Every model of the server, in the order given; the first is the default."""

    def __init__(
        self,
        engines: Sequence[NamedEngine],
        limits: ServingLimits,
        metrics: ServerMetrics,
        state: ServerState,
        calibration: EmbeddingCalibration | None = None,
    ) -> None:
        """`calibration`: the int8 / uint8 ranges (--embedding-calibration), for every model."""
        if not engines:
            raise ValueError("a server needs at least one model")
        self.models: list[ServedModel] = []
        self._by_name: dict[str, ServedModel] = {}
        for named in engines:
            serving = OpenAIServing(named.engine, list(named.names), limits, calibration)
            tokenization = OpenAIServingTokenization(serving)
            generation = OpenAIServingGeneration(
                named.engine,
                serving,
                tokenization,
                metrics,
                state,
                limits.enable_prompt_tokens_details,
            )
            model = ServedModel(
                named.names,
                named.engine,
                serving,
                tokenization,
                generation,
                OpenAIServingSparse(serving),
                CohereServing(serving),
                TeiServing(serving),
            )
            for name in named.names:
                check_served_name(name)
                if name in self._by_name:
                    raise ValueError(f"the served model name {name!r} is given to two models")
                self._by_name[name] = model
            self.models.append(model)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def resolve(self, requested: str | None) -> ServedModel:
        """The model a request names; None or "" → the default; 404 for a name not served."""
        if not requested:
            return self.default
        model = self._by_name.get(requested)
        if model is None:
            served = ", ".join(self._by_name)
            raise ApiError(
                404,
                f"The model `{requested}` does not exist (this server serves: {served}).",
                "model",
            )
        return model

    def resolve_tei(
        self, requested: str | None, query: Mapping[str, str], task: str
    ) -> ServedModel:
        """A TEI route's model: the body's `model` or `?model=` (both: they must agree), else
        the first model that serves `task`."""
        in_query = query.get("model")
        if requested and in_query and requested != in_query:
            raise ApiError(
                400,
                f"the body names the model `{requested}` and ?model= names `{in_query}`: give one",
                "model",
            )
        name = requested or in_query
        return self.resolve(name) if name else self.serving_task(task)

    def serving_task(self, task: str | None) -> ServedModel:
        """The first model that serves the pooling task (None: any), else the default (which
        then answers its own 400): for the routes whose requests name no model (TEI's)."""
        if task is not None:
            for model in self.models:
                if task in model.engine.supported_tasks:
                    return model
        return self.default

    def model_list(self) -> p.ModelList:
        return p.ModelList(data=[card for m in self.models for card in m.serving.models().data])

    def health(self) -> dict[str, Any]:
        """Each model's state, by its first name: {"models": {name: "running" | "stopped"}}."""
        states = {m.name: "running" if m.engine.is_running else "stopped" for m in self.models}
        return {
            "status": "ok" if all(s == "running" for s in states.values()) else "error",
            "models": states,
        }


def check_served_name(name: str) -> str:
    """A name a client can send in `model`: not empty, no spaces around it (ValueError)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"a served model name cannot be empty ({name!r}): a request naming no model goes to "
            "the first model already; give each --served-model-name a name"
        )
    if name != name.strip():
        raise ValueError(f"the served model name {name!r} has spaces around it: remove them")
    return name


# ---------------------------------------------------------------------- loading


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024


def load_engines(
    models: Sequence[str], names: Sequence[Sequence[str]], **engine_args: Any
) -> list[NamedEngine]:
    """Build one AsyncEngine per model (the same engine arguments for each), logging the memory
    each load took (resident memory before and after; on a GPU, the memory torch allocated)."""
    engines = []
    for model, model_names in zip(models, names, strict=True):
        rss_before, gpu_before, start = rss_bytes(), _gpu_bytes(), time.perf_counter()
        engine = AsyncEngine.from_args(model, **engine_args)
        rss_after, gpu_after = rss_bytes(), _gpu_bytes()
        logger.info(
            "loaded %s as %s in %.1f s: resident memory %.0f MiB → %.0f MiB (+%.0f MiB)%s",
            model,
            ", ".join(model_names),
            time.perf_counter() - start,
            rss_before / 2**20,
            rss_after / 2**20,
            (rss_after - rss_before) / 2**20,
            f", GPU +{(gpu_after - gpu_before) / 2**20:.0f} MiB" if gpu_after else "",
        )
        engines.append(NamedEngine(engine, tuple(model_names)))
    return engines


def _gpu_bytes() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
