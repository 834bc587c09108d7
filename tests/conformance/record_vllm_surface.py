"""Record vLLM's public surface (the names tidepool mirrors) into vllm_surface.json.

Run it with the interpreter of an environment that has vLLM installed (the peer venv built by
benchmarks/peer_venvs.sh):

    /work/venv-vllm/bin/python tests/conformance/record_vllm_surface.py

It writes, sorted: LLM.__init__'s keywords, EngineArgs' fields, `vllm serve`'s flags (its own
parser), PoolingParams' and SamplingParams' fields, and the fields of the pooling routes'
request models (embeddings, classify, pooling, score, rerank, tokenize). test_vllm_surface.py
checks that tidepool implements or refuses each name (never ignores one silently).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("vllm_surface.json")


def _fields(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return sorted(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))
    if hasattr(cls, "model_fields"):  # pydantic
        return sorted(cls.model_fields)
    if hasattr(cls, "__struct_fields__"):  # msgspec
        return sorted(n for n in cls.__struct_fields__ if not n.startswith("_"))
    raise TypeError(f"{cls!r}: not a dataclass, pydantic model or msgspec struct")


def _serve_flags() -> list[str]:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    flags = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags.update(s for s in action.option_strings if s.startswith("--"))
    return sorted(flags)


def _request_models() -> dict[str, list[str]]:
    from vllm.entrypoints.pooling.classify import protocol as classify
    from vllm.entrypoints.pooling.embed import protocol as embed
    from vllm.entrypoints.pooling.pooling import protocol as pooling
    from vllm.entrypoints.pooling.scoring import protocol as scoring
    from vllm.entrypoints.serve.tokenize import protocol as tokenize

    models = {
        "EmbeddingCompletionRequest": embed.EmbeddingCompletionRequest,
        "EmbeddingChatRequest": embed.EmbeddingChatRequest,
        "ClassificationCompletionRequest": classify.ClassificationCompletionRequest,
        "ClassificationChatRequest": classify.ClassificationChatRequest,
        "PoolingCompletionRequest": pooling.PoolingCompletionRequest,
        "PoolingChatRequest": pooling.PoolingChatRequest,
        "ScoreQueriesDocumentsRequest": scoring.ScoreQueriesDocumentsRequest,
        "ScoreQueriesItemsRequest": scoring.ScoreQueriesItemsRequest,
        "ScoreTextRequest": scoring.ScoreTextRequest,
        "ScoreDataRequest": scoring.ScoreDataRequest,
        "RerankRequest": scoring.RerankRequest,
        "TokenizeCompletionRequest": tokenize.TokenizeCompletionRequest,
        "TokenizeChatRequest": tokenize.TokenizeChatRequest,
    }
    return {name: _fields(cls) for name, cls in models.items()}


def record() -> dict:
    import vllm
    from vllm import LLM, EngineArgs, PoolingParams, SamplingParams

    llm_args = [
        name
        for name, p in inspect.signature(LLM.__init__).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return {
        "vllm_version": vllm.__version__,
        "llm_init": sorted(llm_args),
        "engine_args": _fields(EngineArgs),
        "serve_flags": _serve_flags(),
        "pooling_params": _fields(PoolingParams),
        "sampling_params": _fields(SamplingParams),
        "requests": _request_models(),
    }


def main() -> int:
    surface = record()
    OUT.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    counts = {k: len(v) for k, v in surface.items() if isinstance(v, list)}
    print(f"vLLM {surface['vllm_version']}: {counts} → {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
