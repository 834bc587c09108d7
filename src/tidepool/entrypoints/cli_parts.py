"""Parts of the `tidepool` command kept beside cli.py: the help formatter (each flag's default),
the warning before `serve` exposes an unprotected server, the shared-work flags of `serve`, and
the `example-models` subcommand."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from tidepool.engine.shared_work import SharedWorkOptions
from tidepool.entrypoints.cli_args import add_hub_args


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.nargs == 0 and action.default is False:  # a switch
            return f"{text} (default: off)"
        return super()._get_help_string(action)


def add_shared_work_args(parser: argparse.ArgumentParser) -> None:
    """Shared work between pooling requests (engine/shared_work.py; docs/server.md)."""
    parser.add_argument(
        "--embedding-cache-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="keep pooling results up to this much memory (LRU; one per distinct token ids + "
        "parameters, priced by its real tensors) and answer repeats from it: bytes, or with a "
        "unit, 512MiB, 2GB, 64K (default: 256MiB when --embedding-cache-size is given, "
        "else no cache; 0 = no cache)",
    )
    parser.add_argument(
        "--embedding-cache-size",
        type=_non_negative_int,
        default=0,
        help="at most this many cached results as well (entries; the byte bound always holds: "
        "one per-token result can take megabytes); 0 = no entry bound",
    )
    parser.add_argument(
        "--disable-shared-work",
        action="store_true",
        help="compute every pooling input, even one identical to an input waiting or running",
    )


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


_UNITS = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
    "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
}  # fmt: skip


def byte_size(value: str) -> int:
    """'1048576', '512MiB', '2GB', '64k' → bytes (>= 0)."""
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("kmgib")
    unit = text[len(number) :]
    try:
        if unit not in _UNITS:
            raise ValueError
        size = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a size: give bytes, or a number with K, KB, KiB, M, MB, MiB, G, "
            "GB or GiB"
        ) from None
    if size < 0 or size != size:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return int(size)


def shared_work_options(args: argparse.Namespace) -> SharedWorkOptions:
    return SharedWorkOptions(
        share_in_flight=not args.disable_shared_work,
        cache_size=args.embedding_cache_size,
        cache_bytes=args.embedding_cache_bytes,
    )


def serve_api_key(flag: str | None) -> str | None:
    """`serve`'s key: --api-key, else TIDEPOOL_API_KEY (envs.api_key's variable, read here as
    set, so that an empty one is refused instead of read as none), else None. ValueError for an
    empty key or one with whitespace around it (middleware.check_api_key)."""
    from tidepool.entrypoints.openai.middleware import check_api_key

    if flag is not None:
        return check_api_key(flag, "--api-key")
    from_env = os.environ.get("TIDEPOOL_API_KEY")
    if from_env is not None:
        return check_api_key(from_env, "TIDEPOOL_API_KEY")
    return None


ALL_INTERFACES = ("", "0.0.0.0", "::", "[::]")


def exposure_warning(host: str | None, api_key: str | None) -> str | None:
    """What `serve` warns about before it binds, if anything: every interface and no key."""
    if api_key or (host is not None and host not in ALL_INTERFACES):
        return None
    shown = host or "0.0.0.0"
    return (
        f"binding all interfaces ({shown}) without --api-key: anyone who can reach this machine "
        "can use the server; pass --host 127.0.0.1 to serve this machine only, or --api-key KEY"
    )


def add_example_models_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "example-models",
        formatter_class=HelpFormatter,
        help="build tiny models with RANDOM weights, offline, for trying the API",
        description="Build a tiny cross-encoder (BertForSequenceClassification, one label) with "
        "random weights (fixed seed) and the bundled model's tokenizer into "
        "FOLDER/cross-encoder-seedSEED. "
        "Its scores mean nothing: it is for trying LLM.score, /score and /rerank without a "
        "download.",
    )
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        default=None,
        help="where to build them (default: tidepool's cache folder, ~/.cache/tidepool/examples)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.set_defaults(func=cmd_example_models)


def cmd_example_models(args: argparse.Namespace) -> int:
    from tidepool.examples import example_cross_encoder

    path = example_cross_encoder(args.folder, seed=args.seed)
    print(f"{path}  (random weights: for trying the API, its scores mean nothing)")
    return 0


# ---------------------------------------------------------------------- download


def add_download_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "download",
        formatter_class=HelpFormatter,
        help="fetch a Hub model into the Hugging Face cache ahead of time",
        description="Download the files of MODEL that tidepool loads (config, tokenizer, "
        "safetensors, sentence-transformers modules; no ONNX / TF / Flax / duplicate .bin) into "
        "the Hugging Face cache, and print the snapshot's folder. A later load finds it there, "
        "also with HF_HUB_OFFLINE=1.",
    )
    parser.add_argument(
        "model", metavar="MODEL", help="Hub model id, e.g. BAAI/bge-small-en-v1.5 (no default)"
    )
    add_hub_args(parser)
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="also fetch the model's own code (*.py), which trust_remote_code=True runs",
    )
    parser.set_defaults(func=cmd_download)


def cmd_download(args: argparse.Namespace) -> int:
    from tidepool.checkpoint.loader import fetch_snapshot

    location = fetch_snapshot(
        args.model,
        revision=args.revision,
        download_dir=args.download_dir,
        hf_token=args.hf_token,
        trust_remote_code=args.trust_remote_code,
    )
    print(location.path)
    return 0
