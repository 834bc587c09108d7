"""Entry points whose keyword arguments a dataclass owns still show them in their signature."""

from __future__ import annotations

import dataclasses
import inspect

from tidepool.entrypoints.llm import LLM, EngineArgs
from tidepool.ray.data import Predictor, PredictorOptions, map_dataset


def _keyword_defaults(function) -> dict:
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY}


def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_dataclass_fields_show_as_keyword_parameters() -> None:
    fields = _field_defaults(EngineArgs)
    fields.pop("model")  # LLM's first, positional parameter
    assert _keyword_defaults(LLM) == fields
    llm_params = list(inspect.signature(LLM).parameters)
    assert llm_params[0] == "model" and llm_params[-1] == "kwargs"  # vLLM's other arguments
    predictor = _keyword_defaults(Predictor)
    assert list(predictor) == [*_field_defaults(PredictorOptions), "num_threads", "engine_kwargs"]
    assert predictor["truncate_prompt_tokens"] == -1
    # Predictor takes nothing but its options as **options: no **kwargs shown.
    kinds = [p.kind for p in inspect.signature(Predictor).parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    params = list(inspect.signature(map_dataset).parameters)
    assert params[:3] == ["ds", "model", "task"] and params[-1] == "map_batches_kwargs"
