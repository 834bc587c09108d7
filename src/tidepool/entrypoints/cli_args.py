"""The flags `tidepool serve` and `tidepool embed` share (the engine's, named as `vllm serve`'s),
their argparse types, and turning them into `LLM` / `AsyncEngine` arguments."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from tidepool.models.loader import DEFAULT_MODEL

logger = logging.getLogger("tidepool")

# `vllm serve` flags that mean nothing here: accepted and ignored so launch scripts keep working.
_IGNORED_VLLM_FLAGS = (
    ("--gpu-memory-utilization", float),
    ("--tensor-parallel-size", int),
    ("--pipeline-parallel-size", int),
    ("--swap-space", float),
    ("--task", str),
)
_IGNORED_VLLM_SWITCHES = (
    "--enforce-eager",
    "--disable-log-stats",
    "--disable-log-requests",
    "--enable-prefix-caching",
)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `serve` and `embed` (names as `vllm serve`)."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"model folder or id (default: the bundled {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="the model, as a flag (same as MODEL); `serve` takes it more than once to serve "
        "several models, each on its own engine (default: MODEL)",
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument(
        "--quantization",
        default=None,
        help="int8: int8 weights and activations in a native encoder's linear layers (CPU, "
        "float32 elsewhere); default: none",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt, tokens (default: the model's own maximum)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step (default: sized for the model and device)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences per step")
    parser.add_argument("--seed", type=int, default=0, help="random seed (sampling)")
    parser.add_argument("--device", default=None, help="torch device (default: CUDA if present)")
    parser.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "pooling", "generate"],
        help="pooling (embed, classify, score) or generate; auto: from the architecture",
    )
    parser.add_argument(
        "--convert",
        default="auto",
        choices=["auto", "embed", "classify"],
        help="what a pooling runner makes of the model; auto: from the architecture",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model folder's own Python code (transformers' trust_remote_code)",
    )
    add_hub_args(parser)
    parser.add_argument(
        "--hf-overrides",
        type=json.loads,
        default=None,
        help="JSON object of config.json keys to replace (e.g. an LLM reranker's; default: none)",
    )
    parser.add_argument(
        "--score-template",
        default=None,
        help="LLM rerankers: the pair prompt with {query} and {document}, a file, or a built-in "
        "(qwen3_reranker); default none: the pair as given (vLLM's concatenation)",
    )
    parser.add_argument(
        "--score-instruction",
        default=None,
        help="the score template's {instruction} (default: the built-in's)",
    )
    parser.add_argument(
        "--pooler-config",
        type=json.loads,
        default=None,
        help="pooler options as JSON (vLLM's), e.g. '{\"enable_chunked_processing\": true, "
        '"max_embed_len": 100000}\': inputs longer than max_model_len run in chunks '
        "(default: none, such inputs are refused)",
    )
    for flag, kind in _IGNORED_VLLM_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    for flag in _IGNORED_VLLM_SWITCHES:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


def add_hub_args(parser: argparse.ArgumentParser) -> None:
    """Where a model id comes from (EngineArgs' revision, download_dir, hf_token)."""
    parser.add_argument(
        "--revision",
        default=None,
        help="Hub revision of a model id: a branch, tag or commit (default: the default branch)",
    )
    parser.add_argument(
        "--download-dir",
        default=None,
        help="Hugging Face cache to look in and download to (default: HF_HUB_CACHE, else "
        "$HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    parser.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        default=None,
        metavar="TOKEN",
        help="Hub token for private or gated models; alone: the one saved by `hf auth login` "
        "(default: HF_TOKEN, else that one)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    ignored = [f for f, _ in _IGNORED_VLLM_FLAGS if getattr(args, _dest(f)) is not None]
    ignored += [f for f in _IGNORED_VLLM_SWITCHES if getattr(args, _dest(f))]
    if ignored:
        logger.info("ignoring vLLM flags that do not apply here: %s", ", ".join(ignored))
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "seed": args.seed,
        "device": args.device,
        "runner": args.runner,
        "convert": args.convert,
        "trust_remote_code": args.trust_remote_code,
        "revision": args.revision,
        "download_dir": args.download_dir,
        "hf_token": args.hf_token,
        "hf_overrides": args.hf_overrides,
        "score_template": args.score_template,
        "score_instruction": args.score_instruction,
        "pooler_config": args.pooler_config,
    }


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _model_args(args: argparse.Namespace) -> list[str]:
    """MODEL, then each --model, in order (MODEL repeated as the first --model counts once)."""
    flags = list(args.model or [])
    if args.model_tag and flags and flags[0] == args.model_tag:
        flags = flags[1:]
    models = ([args.model_tag] if args.model_tag else []) + flags
    repeated = sorted({m for m in models if models.count(m) > 1})
    if repeated:
        raise SystemExit(f"error: the model {repeated[0]!r} is given twice")
    return models or [DEFAULT_MODEL]


def _model_arg(args: argparse.Namespace) -> str:
    models = _model_args(args)
    if len(models) > 1:
        raise SystemExit(f"error: two models given: {' and '.join(map(repr, models))}")
    return models[0]


# ---------------------------------------------------------------------- serve


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a TCP port: give 1-65535 (or 0 for a free one)"
        )
    return port
