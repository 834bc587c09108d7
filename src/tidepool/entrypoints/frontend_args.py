"""`vllm serve`'s frontend flags on `tidepool serve`: the ones tidepool implements (root path,
CORS, docs, request logging, TLS) and the others, refused or warned about by name when given
(never "unrecognized arguments", never silently ignored)."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

logger = logging.getLogger("tidepool")

_ONE_ENGINE = "one engine process per model (no data-parallel supervisor)"

# vLLM frontend flags tidepool does not implement: flag → (refuse?, reason, switch?, unset values)
_NOT_HERE: dict[str, tuple[bool, str, bool, tuple[Any, ...]]] = {
    "--lora-modules": (True, "tidepool has no LoRA adapters", False, ()),
    "--chat-template-content-format": (
        True,
        "message content is rendered as a string (auto / string)",
        False,
        ("auto", "string"),
    ),
    "--response-role": (True, "the reply's role is always assistant", False, ("assistant",)),
    "--middleware": (True, "no extra ASGI middleware by import path", False, ()),
    "--return-tokens-as-token-ids": (True, "logprob tokens are returned as text", True, ()),
    "--enable-auto-tool-choice": (True, "generation has no tool calling", True, ()),
    "--exclude-tools-when-tool-choice-none": (True, "generation has no tool calling", True, ()),
    "--tool-call-parser": (True, "generation has no tool calling", False, ()),
    "--tool-parser-plugin": (True, "generation has no tool calling", False, ("",)),
    "--tool-server": (True, "generation has no tool calling", False, ()),
    "--log-config-file": (True, "logging is configured by Python's logging module", False, ()),
    "--enable-server-load-tracking": (
        True,
        "/metrics has the load (num_requests_in_flight)",
        True,
        (),
    ),
    "--enable-force-include-usage": (
        True,
        "usage is sent when stream_options ask for it",
        True,
        (),
    ),
    "--enable-tokenizer-info-endpoint": (True, "there is no /tokenizer_info route", True, ()),
    "--enable-log-outputs": (True, "outputs are not logged", True, ()),
    "--h11-max-incomplete-event-size": (True, "uvicorn's h11 limits are its defaults", False, ()),
    "--h11-max-header-count": (True, "uvicorn's h11 limits are its defaults", False, ()),
    "--log-error-stack": (True, "errors are logged without their stack", True, ()),
    "--headless": (True, "the server always has its API", True, ()),
    "--api-server-count": (True, "one API server process per engine", False, (1,)),
    "--enable-ssl-refresh": (True, "TLS files are read once at start", True, ()),
    "--ssl-cert-reqs": (True, "client certificates are not requested", False, (0,)),
    "--uds": (True, "the server listens on TCP only", False, ()),
    "--tokens-only": (True, "the server always takes text", True, ()),
    "--enable-request-id-headers": (True, "responses carry no X-Request-Id header", True, ()),
    "--anthropic-disabled-thinking-effort": (True, "there is no Anthropic API", False, ("auto",)),
    "--cohere-format": (True, "there is no Cohere chat API", False, ("cmd4",)),
    "--cohere-is-reasoning-model": (True, "there is no Cohere chat API", True, (True,)),
    "--config": (True, "flags are read from the command line only (no YAML file)", False, ()),
    "--data-parallel-supervisor-port": (True, _ONE_ENGINE, False, (9256,)),
    "--dp-supervisor-probe-failure-threshold": (True, _ONE_ENGINE, False, (3,)),
    "--dp-supervisor-probe-interval-s": (True, _ONE_ENGINE, False, (5.0,)),
    "--dp-supervisor-probe-timeout-s": (True, _ONE_ENGINE, False, (5.0,)),
    "--default-chat-template-kwargs": (
        True,
        "chat templates take their keywords per request (chat_template_kwargs)",
        False,
        (),
    ),
    "--device-memory-utilization": (
        True,
        "the KV cache is sized by --kv-cache-memory-bytes / --kv-cache-memory-fraction",
        False,
        (0.92,),
    ),
    "--disable-access-log-for-endpoints": (
        True,
        "the access log is on or off as a whole (--disable-uvicorn-access-log)",
        False,
        (),
    ),
    "--enable-log-deltas": (True, "outputs are not logged", True, (True,)),
    "--enable-offline-docs": (True, "/docs loads its assets as FastAPI serves them", True, ()),
    "--enable-per-request-metrics": (True, "/metrics has no per-request metrics", True, ()),
    "--enable-scale-out": (True, "one server process per engine (no scale-out)", True, ()),
    "--fingerprint-mode": (True, "responses carry no server fingerprint", False, ("full",)),
    "--fingerprint-value": (True, "responses carry no server fingerprint", False, ()),
    "--grpc": (True, "the server speaks HTTP only (no gRPC)", True, ()),
    "--grpc-port": (True, "the server speaks HTTP only (no gRPC)", False, ()),
    "--sse-keep-alive-interval": (True, "streams send no keep-alive comments", False, (0,)),
    "--tool-strict-level": (True, "generation has no tool calling", False, ("auto",)),
    "--trust-request-mm-kwargs": (True, "tidepool serves text models only", True, ()),
    "--enable-flash-late-interaction": (
        False,
        "MaxSim runs whole per pair (no flash late-interaction kernel)",
        True,
        (True,),
    ),
    "--disable-frontend-multiprocessing": (
        False,
        "the API server and engine share a process",
        True,
        (),
    ),
}


FRONTEND_DESTS = frozenset(flag.lstrip("-").replace("-", "_") for flag in _NOT_HERE)
"""The refused / warned frontend flags' names (vLLM has some as engine arguments too)."""


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return [value]
    return parsed if isinstance(parsed, list) else [str(parsed)]


def _loose(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's serve frontend flags (FrontendArgs / AsyncEngineArgs) on `tidepool serve`."""
    group = parser.add_argument_group("vLLM frontend flags")
    group.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves this server under (FastAPI's root_path; "
        "default: none)",
    )
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        help="CORS: origins allowed, a JSON list (e.g. '[\"*\"]'); default: none, no CORS "
        "headers are sent (vLLM allows every origin by default)",
    )
    switch = argparse.BooleanOptionalAction
    group.add_argument(
        "--allow-credentials", action=switch, default=False, help="CORS: allow credentials"
    )
    group.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=None,
        help='CORS: methods allowed, a JSON list (default: ["*"] once CORS is on)',
    )
    group.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=None,
        help='CORS: headers allowed, a JSON list (default: ["*"] once CORS is on)',
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action=switch,
        default=False,
        help="no /docs, /redoc or /openapi.json",
    )
    group.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request: route and body, cut to --max-log-len characters",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="deprecated in vLLM (requests are not logged unless --enable-log-requests)",
    )
    group.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: characters of each body logged (default: none, all)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action=switch,
        default=False,
        help="accept a request's own chat_template (chat completions, /tokenize, pooling "
        "messages); without it such a request is refused (400), as in vLLM",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action=switch,
        default=False,
        help="generation usage reports prompt_tokens_details.cached_tokens (the prompt tokens "
        "read from the prefix cache)",
    )
    for flag in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-ciphers"):
        group.add_argument(
            flag, default=None, help="TLS (uvicorn's option of that name; default: none)"
        )
    switch_action = argparse.BooleanOptionalAction
    for flag, (_, _, switch, _) in _NOT_HERE.items():
        if switch:
            parser.add_argument(
                flag, action=switch_action, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
        else:
            parser.add_argument(
                flag, type=_loose, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )


def check_frontend_args(args: argparse.Namespace) -> None:
    """SystemExit naming a vLLM frontend flag tidepool refuses; a warning for a harmless one."""
    for flag, (refuse, reason, _, unset) in _NOT_HERE.items():
        dest = flag.lstrip("-").replace("-", "_")
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value in (None, False, *unset):
            continue
        if refuse:
            raise SystemExit(f"error: {flag} is not supported by tidepool: {reason}")
        logger.warning("%s has no effect here: %s", flag, reason)
    if getattr(args, "disable_log_requests", False):
        logger.warning("--disable-log-requests is deprecated: requests are not logged by default")


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS keywords of the flags given."""
    names = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_ciphers")
    return {name: getattr(args, name) for name in names if getattr(args, name, None)}
