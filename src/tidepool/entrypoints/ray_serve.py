"""Ray Serve: N replicas of the OpenAI-compatible server, each with an engine of its own.

    serve run tidepool.entrypoints.ray_serve:app_builder model=sentence-transformers/all-MiniLM-L6-v2 \\
        num_replicas=4 num_cpus=2 max_model_len=256

or from Python:

    from ray import serve
    from tidepool.entrypoints.ray_serve import build_serve_app

    serve.run(build_serve_app("BAAI/bge-small-en-v1.5", num_replicas=4), route_prefix="/")

Each replica builds the app of `tidepool serve` (`entrypoints.openai.server.build_app`) over its
own AsyncEngine, inside the replica: the routes, JSON and errors are those of `tidepool serve`,
and the app's lifespan starts and drains the engine there. Serve's proxy spreads requests over
the replicas; each replica batches the requests it holds, so it may hold many
(`max_ongoing_requests`, default 64, where Serve's own default of 5 would starve its batches).
`/metrics` and `/health` answer for the replica that served the call; Serve exports its own
per-deployment metrics as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidepool.checkpoint.loader import DEFAULT_MODEL

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve import Application

    from tidepool.entrypoints.openai.server import ServerArgs

DEPLOYMENT_NAME = "tidepool"
DEFAULT_MAX_ONGOING_REQUESTS = 64


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica needs to build its app; travels to the replicas pickled."""

    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    server_args: ServerArgs | None = None
    num_threads: int | None = None
    """torch threads of the replica's engine: its share of the node's CPUs."""


def build_replica_app(spec: ReplicaSpec) -> FastAPI:
    """The `tidepool serve` app over a new engine; runs inside a replica."""
    import torch

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    if spec.num_threads is not None:
        os.environ.setdefault("RAYON_NUM_THREADS", str(spec.num_threads))
    engine = AsyncEngine.from_args(spec.model, **spec.engine_kwargs)
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    # As `tidepool serve`: clients may send the model argument as `model`.
    server_args = spec.server_args or ServerArgs(served_model_name=[spec.model])
    return build_app(engine, server_args)


def build_serve_app(
    model: str = DEFAULT_MODEL,
    *,
    num_replicas: int = 1,
    num_cpus: float = 1,
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
    engine_kwargs: dict[str, Any] | None = None,
    server_args: ServerArgs | None = None,
    name: str = DEPLOYMENT_NAME,
    **deployment_options: Any,
) -> Application:
    """A Serve application of `num_replicas` replicas (or as `autoscaling_config` decides), each
    reserving `num_cpus` (its engine runs as many threads). `engine_kwargs` are LLM's arguments;
    `server_args` those of `tidepool serve` (API key, served model names, limits);
    `deployment_options` go to `serve.deployment` (`autoscaling_config`, `health_check_period_s`).
    """
    from ray import serve

    spec = ReplicaSpec(
        model=model,
        engine_kwargs=dict(engine_kwargs or {}),
        server_args=server_args,
        num_threads=max(1, int(num_cpus)),
    )

    # Serve calls the builder in each replica, so the engine is made there, never pickled.
    def build_asgi_app() -> FastAPI:
        return build_replica_app(spec)

    if "autoscaling_config" not in deployment_options:  # Serve refuses both at once
        deployment_options["num_replicas"] = num_replicas
    ingress = serve.ingress(build_asgi_app)()
    deployment = serve.deployment(
        ingress,
        name=name,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus},
        **deployment_options,
    )
    return deployment.bind()


# Arguments of `app_builder` that are not the engine's.
_DEPLOYMENT_ARGS = ("num_replicas", "num_cpus", "max_ongoing_requests")
_SERVER_ARGS = (
    "api_key",
    "served_model_name",
    "max_request_body_bytes",
    "max_inputs_per_request",
    "shutdown_timeout_s",
)

# Never numbers, even when they look like one (an API key of digits).
_TEXT_ARGS = ("model", "api_key", "served_model_name", "dtype", "device", "runner", "convert")


def app_builder(args: dict[str, str]) -> Application:
    """For `serve run tidepool.entrypoints.ray_serve:app_builder key=value ...` and Serve config files.

    Keys: model, num_replicas, num_cpus, max_ongoing_requests; the server's api_key,
    served_model_name (comma-separated), max_request_body_bytes, max_inputs_per_request,
    shutdown_timeout_s; anything else is an engine argument (dtype, max_model_len, ...).
    """
    from tidepool.entrypoints.openai.server import ServerArgs

    values = {k: v if k in _TEXT_ARGS else _parse_value(v) for k, v in args.items()}
    model = str(values.pop("model", DEFAULT_MODEL))
    deployment = {k: values.pop(k) for k in _DEPLOYMENT_ARGS if k in values}
    server = {k: values.pop(k) for k in _SERVER_ARGS if k in values}
    names = server.pop("served_model_name", None)
    server_args = ServerArgs(
        served_model_name=str(names).split(",") if names is not None else [model],
        **server,
    )
    return build_serve_app(model, engine_kwargs=values, server_args=server_args, **deployment)


def _parse_value(value: Any) -> Any:
    """Command-line text → int, float or bool where it is one (config files give typed values)."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
