"""The `tidepool` command: `serve` (OpenAI-compatible server), `embed` (batch jobs, demo) and
`download` (a Hub model into the Hugging Face cache, ahead of time).

Flag names follow `vllm serve` so that scripts port by changing the program name.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidepool.entrypoints.cli_args import (
    _add_engine_args,
    _engine_kwargs,
    _model_arg,
    _model_args,
    _port,
    _positive_float,
    _positive_int,
)
from tidepool.entrypoints.cli_parts import (
    HelpFormatter,
    add_download_parser,
    add_example_models_parser,
    add_shared_work_args,
    exposure_warning,
    serve_api_key,
    shared_work_options,
)
from tidepool.entrypoints.frontend_args import (
    add_frontend_args,
    check_frontend_args,
    uvicorn_options,
)
from tidepool.jobs.local import ON_ERROR

logger = logging.getLogger("tidepool")


def _add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter
    )
    _add_engine_args(parser)
    parser.add_argument(
        "--host",
        default=None,
        help="address to bind (default: all interfaces, 0.0.0.0; give 127.0.0.1 for this "
        "machine only)",
    )
    parser.add_argument(
        "--port", type=_port, default=8000, help="TCP port, 1-65535; 0 = a free one (logged)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or set TIDEPOOL_API_KEY; default: none, "
        "every client is served)",
    )
    parser.add_argument(
        "--served-model-name",
        dest="served_model_name_groups",
        action="append",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients may use in `model`; the first is echoed back (default: the model "
        "argument). Several models: one --served-model-name per model, in order (or one with a "
        "name per model)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        "--max-input-bytes",
        "--payload-limit",
        dest="max_request_body_bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="larger request bodies get 413 before they are read (default: 32 MiB)",
    )
    parser.add_argument(
        "--max-inputs-per-request",
        "--max-batch-size",
        "--max-client-batch-size",
        dest="max_inputs_per_request",
        type=int,
        default=2048,
        help="more inputs (texts, documents, pairs) in one request get 413 (default: 2048)",
    )
    _add_admission_args(parser)
    parser.add_argument(
        "--shutdown-timeout",
        dest="shutdown_timeout_s",
        type=float,
        default=30.0,
        help="seconds to finish in-flight requests on SIGTERM",
    )
    parser.add_argument(
        "--embedding-calibration",
        default=None,
        metavar="FILE",
        help="int8/uint8 embedding ranges: a .npy of shape [2, dim], or texts, one per line "
        "(default: none, int8/uint8 requests get 400)",
    )
    parser.add_argument(
        "--api-style",
        default="openai",
        choices=["openai", "tei"],
        help="who answers /rerank and /tokenize: vLLM's shapes (openai) or TEI's (default: openai)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    parser.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no line per HTTP request",
    )
    add_shared_work_args(parser)
    add_frontend_args(parser)
    parser.set_defaults(func=cmd_serve)


def _add_admission_args(parser: argparse.ArgumentParser) -> None:
    """Admission control (entrypoints/openai/admission.py; docs/server.md)."""
    parser.add_argument(
        "--max-concurrent-requests",
        type=_positive_int,
        default=512,
        help="requests to model routes in flight at once, all models together; more get 429 "
        "with Retry-After (default: 512, as TEI)",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=_positive_int,
        default=None,
        help="prompt tokens admitted and not yet finished, all models together; more get 429, "
        "a request over it alone 413 (default: sized for this machine, 1/8 of its memory at "
        "1 KiB per token)",
    )
    parser.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="abort a request still queued or running this long after it arrived (its KV "
        "blocks freed) and answer 503 with Retry-After (default: no deadline)",
    )


def _served_names(args: argparse.Namespace, models: list[str]) -> list[list[str]]:
    """Each model's served names: one --served-model-name group per model, or (several models)
    one group with a name per model; none: the model argument."""
    from tidepool.entrypoints.openai.served_models import check_served_name

    groups = args.served_model_name_groups
    for name in [n for group in groups or [] for n in group]:
        check_served_name(name)  # ValueError: one line, before any model loads
    if not groups:
        return [[model] for model in models]
    if len(groups) == len(models):
        return [list(group) for group in groups]
    if len(groups) == 1 and len(groups[0]) == len(models):
        return [[name] for name in groups[0]]
    raise SystemExit(
        f"error: {len(models)} models and {len(groups)} --served-model-name: give one "
        "--served-model-name per --model, in order"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tidepool.entrypoints.openai.served_models import load_engines
    from tidepool.entrypoints.openai.server import build_app

    check_frontend_args(args)
    models = _model_args(args)
    names = _served_names(args, models)
    args.api_key = serve_api_key(args.api_key)  # checked before any model loads
    engines = load_engines(
        models, names, shared_work=shared_work_options(args), **_engine_kwargs(args)
    )
    app = build_app(engines, args)
    for model, model_names in zip(models, names, strict=True):
        logger.info("serving %s as %s", model, ", ".join(model_names))
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        logger.warning(warning)
    # uvicorn turns SIGTERM / SIGINT into a graceful shutdown: it stops accepting connections,
    # lets in-flight requests finish (up to the timeout), then the app's lifespan drains the engine.
    config = uvicorn.Config(
        app,
        host=args.host if args.host is not None else "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=int(args.shutdown_timeout_s),
        **uvicorn_options(args),
    )
    uvicorn.Server(config).run()
    return 0


# ---------------------------------------------------------------------- embed


def _add_embed_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "embed",
        formatter_class=HelpFormatter,
        help="embed a file of texts (resumable), or --demo",
        description="Embed INPUT (.txt, .jsonl, .parquet) into OUTPUT (.jsonl, .parquet, .npy). "
        "A rerun with the same arguments resumes after the rows already written.",
    )
    _add_engine_args(parser)
    parser.add_argument(
        "--input",
        "-i",
        type=_path_or_uri,
        default=None,
        help="texts: .txt (a line each), .jsonl or .parquet (no default: required unless --demo)",
    )
    parser.add_argument(
        "--output",
        "-o",
        type=_path_or_uri,
        default=None,
        help="embeddings: .jsonl, .parquet or .npy (no default: required unless --demo)",
    )
    parser.add_argument("--text-field", default="text", help="jsonl key / parquet column of texts")
    parser.add_argument(
        "--id-field", default=None, help="copy this key / column to the output (default: none)"
    )
    parser.add_argument("--chunk-size", type=int, default=512, help="rows embedded per write")
    parser.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=-1,
        help="keep the first N tokens; -1 (default) = the model's maximum",
    )
    parser.add_argument(
        "--no-truncate",
        action="store_true",
        help="fail on texts longer than the model's maximum instead",
    )
    parser.add_argument(
        "--dimensions",
        type=int,
        default=None,
        help="Matryoshka truncation (default: the model's full embedding)",
    )
    parser.add_argument(
        "--prompt-name",
        default=None,
        help="one of the model's prompts put before each text (default: its default prompt)",
    )
    parser.add_argument(
        "--no-normalize",
        action="store_true",
        help="keep the embeddings unnormalized (default: as the model's modules say)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start again, do not resume (a rerun with other settings is refused without it)",
    )
    parser.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="skip",
        help="a bad row (listed with its line in OUTPUT.errors.jsonl): skip it and exit with "
        "status 1 at the end (default), or fail: stop at it",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="embed a built-in sample corpus offline and print throughput",
    )
    parser.add_argument("--num-demo-texts", type=int, default=300, help="texts --demo embeds")
    _add_ray_embed_args(parser)
    parser.set_defaults(func=cmd_embed)


def _path_or_uri(value: str) -> Path | str:
    """A local path, or a URI kept as text (Path would fold "s3://b" into "s3:/b"); --ray only."""
    return value if "://" in value else Path(value)


def _add_ray_embed_args(parser: argparse.ArgumentParser) -> None:
    """`--ray`: the same job on a Ray cluster (tidepool.jobs.ray_runner; docs/ray.md)."""
    group = parser.add_argument_group("on a Ray cluster (pip install 'tidepool[ray]')")
    group.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run on Ray: a cluster address, 'auto' (the cluster this machine is in) or 'local'; "
        "INPUT may be a folder or URI, OUTPUT is a folder of parquet files, one per shard "
        "(default: this process, no Ray)",
    )
    group.add_argument(
        "--num-actors", type=int, default=None, help="engines (default: one per CPU of the cluster)"
    )
    group.add_argument("--cpus-per-actor", type=float, default=1.0, help="threads per engine")
    group.add_argument(
        "--rows-per-file", type=int, default=10_000, help="input rows per output file (a shard)"
    )


def cmd_embed(args: argparse.Namespace) -> int:
    from tidepool import LLM
    from tidepool.jobs.demo import run_demo

    if not args.demo and (args.input is None or args.output is None):
        raise SystemExit("error: tidepool embed needs --input and --output (or --demo)")
    if args.chunk_size < 1:
        raise SystemExit("error: --chunk-size must be >= 1")
    if args.ray is not None and not args.demo:  # the input may be a folder or a URI there
        if args.rows_per_file < 1:
            raise SystemExit("error: --rows-per-file must be >= 1")
        if args.prompt_name is not None or args.no_normalize:
            raise SystemExit("error: --prompt-name and --no-normalize are not supported with --ray")
        return cmd_embed_ray(args, _model_arg(args), _engine_kwargs(args))
    if isinstance(args.input, str) or isinstance(args.output, str):
        raise SystemExit("error: URIs (s3://, gs://, ...) need --ray; give local paths")
    if not args.demo and (error := _local_path_error(args.input, args.output)):
        print(f"error: {error}", file=sys.stderr)
        return 1
    llm = LLM(_model_arg(args), **_engine_kwargs(args))
    if args.demo:
        run_demo(llm, args.num_demo_texts)
        return 0
    return _run_local_job(llm, args)


def _local_path_error(input_path: Path, output: Path) -> str | None:
    """Checked before the model loads: why the input or output cannot work, if it cannot."""
    from tidepool.jobs.formats import JobError
    from tidepool.jobs.local import check_input_path, check_output_path

    try:
        check_input_path(input_path)
        check_output_path(output)
    except JobError as e:
        return str(e)
    return None


def _run_local_job(llm: Any, args: argparse.Namespace) -> int:
    from tidepool.jobs.formats import JobError
    from tidepool.jobs.local import EmbedJob, run_embed_job

    job = EmbedJob(
        input=args.input,
        output=args.output,
        text_field=args.text_field,
        id_field=args.id_field,
        chunk_size=args.chunk_size,
        truncate_prompt_tokens=None if args.no_truncate else args.truncate_prompt_tokens,
        dimensions=args.dimensions,
        normalize=False if args.no_normalize else None,
        prompt_name=args.prompt_name,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        on_error=args.on_error,
    )
    try:
        result = run_embed_job(llm, job)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk, not the job: full, read-only, gone
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    print(f"embedded {result.num_embedded} rows into {args.output}")
    if result.stopped_at is not None:
        print(f"error: {result.stopped_at.describe()} (--on-error fail)", file=sys.stderr)
        return 1
    if not result.num_skipped:
        return 0
    for bad in result.first_errors:
        print(f"skipped {bad.describe()}", file=sys.stderr)
    shown = len(result.first_errors)
    more = f" ({result.num_skipped - shown} more)" if result.num_skipped > shown else ""
    print(
        f"error: {result.num_skipped} bad rows are not in {args.output}{more}; each is listed "
        f"with its line in {result.errors_path}",
        file=sys.stderr,
    )
    return 1


def cmd_embed_ray(args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any]) -> int:
    """`tidepool embed --ray ADDRESS ...` (the CLI's flags, already parsed)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        print("error: --ray needs Ray: pip install 'tidepool[ray]'", file=sys.stderr)
        return 2
    from tidepool.engine.args import build_engine_config
    from tidepool.jobs.formats import JobError
    from tidepool.jobs.plan import RayEmbedJob
    from tidepool.jobs.ray_runner import run_ray_embed_job

    # A missing model or engine arguments that do not fit fail here, in one line (the CLI's
    # exit status 2), not in every actor after the cluster has started. A Hub model is
    # downloaded here once; every actor then loads the commit the driver saw (its node's cache,
    # filled once per node: checkpoint/hub.py's lock).
    commit = build_engine_config(model, **engine_kwargs).model.commit
    if commit is not None:
        engine_kwargs = {**engine_kwargs, "revision": commit}
    job = RayEmbedJob(
        input=str(args.input),
        output=str(args.output),
        model=model,
        engine_kwargs=engine_kwargs,
        text_field=args.text_field,
        id_field=args.id_field,
        rows_per_file=args.rows_per_file,
        chunk_size=args.chunk_size,
        truncate_prompt_tokens=None if args.no_truncate else args.truncate_prompt_tokens,
        dimensions=args.dimensions,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        num_actors=args.num_actors,
        cpus_per_actor=args.cpus_per_actor,
    )
    try:
        summary = run_ray_embed_job(job, args.ray)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConnectionError as e:  # no cluster at that address
        print(f"error: cannot join the Ray cluster at {args.ray!r}: {e}", file=sys.stderr)
        return 2
    print(
        f"embedded {summary.num_rows} rows into {summary.num_shards - summary.num_skipped} files "
        f"of {args.output} ({summary.num_skipped} were complete already)"
    )
    if summary.num_errors:
        # Every input row has an output row here: a bad one carries its `error`.
        print(f"{summary.num_errors} rows have no embedding: see their `error` column")
        return 1 if args.on_error == "fail" else 0
    return 0


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    import tidepool

    parser = argparse.ArgumentParser(prog="tidepool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tidepool {tidepool.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(subparsers)
    _add_embed_parser(subparsers)
    add_download_parser(subparsers)
    add_example_models_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tidepool.checkpoint.hub import ModelAccessError

    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, ModelAccessError) as e:
        # A model that is not there (or gated, or its token refused) or engine arguments that do
        # not fit: the message is the whole story, a traceback would only bury it.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
