"""Ray Data: one tidepool engine per actor, mapping a column of a Dataset to new columns.

    ds.map_batches(
        Predictor,
        fn_constructor_kwargs={"model": "sentence-transformers/all-MiniLM-L6-v2"},
        compute=ray.data.ActorPoolStrategy(size=4),  # 4 actors, one engine each
        num_cpus=1,
        batch_format="pyarrow",
    )

or `embed_dataset(ds, model, concurrency=4)` for the same. The input columns pass through
untouched (ids stay with their rows); the task adds an output column and an error column:

    embed     embedding  fixed_size_list<float32>[dim]   null where the row failed
    classify  probs      fixed_size_list<float32>[num_labels]
    score     score      float32                          (column and pair_column, per row)
    all       error      string                           null where the row succeeded

Each row's output is a function of that row alone (the engine is batch invariant), so a batch
that Ray retries after an actor died produces the same rows again: nothing is lost or doubled.
A bad row (None, an empty string, a number, too long without truncation) gets a null output and
the reason in the error column; the rest of its batch is computed (`BatchInputError.outputs`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from tidepool.checkpoint.loader import DEFAULT_MODEL
from tidepool.ray.pooling import PooledRows, pool_rows
from tidepool.signatures import fields_as_keywords

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

logger = logging.getLogger("tidepool")

TASKS = ("embed", "classify", "score")
DEFAULT_OUTPUT_COLUMNS = {"embed": "embedding", "classify": "probs", "score": "score"}
OUTPUT_DTYPES = ("float16", "float32", "float64")


# ---------------------------------------------------------------------- arrow columns


def arrow_column(rows: PooledRows, dtype: str, width: int) -> pa.Array:
    """The output column: fixed-size lists (or scalars for score), null where a row failed."""
    import pyarrow as pa

    failed = np.array([e is not None for e in rows.errors], dtype=bool)
    if rows.values.ndim == 1:
        return pa.array(rows.values.astype(dtype), mask=failed)
    values = rows.values if rows.values.shape[1] == width else np.zeros((len(rows.errors), width))
    flat = pa.array(np.ascontiguousarray(values, dtype=dtype).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, width, mask=pa.array(failed))


def error_column(rows: PooledRows) -> pa.Array:
    import pyarrow as pa

    return pa.array(rows.errors, type=pa.string())


# ---------------------------------------------------------------------- the actor


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictorOptions:
    """What a `Predictor` makes of each batch: the one place that owns these options of
    `Predictor(model, **options)` and `map_dataset(ds, model, **options)`."""

    task: str = "embed"
    """ "embed", "classify" or "score"."""
    column: str = "text"
    """The input column (score: the first text of each pair)."""
    pair_column: str | None = None
    """The second text of each pair; score only, and score needs it."""
    output_column: str | None = None
    """None: "embedding", "probs" or "score", by task."""
    error_column: str = "error"
    """Null where the row succeeded, else why it has no output."""
    output_dtype: str = "float32"
    """Of the output values: float16, float32 or float64."""
    dimensions: int | None = None
    """embed: keep the first N dimensions (Matryoshka models)."""
    normalize: bool | None = None
    """embed: L2-normalize; None: what the model's configuration says."""
    truncate_prompt_tokens: int | None = -1
    """Keep the first N tokens of each row; -1: the model's maximum; None: a longer row fails."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if (self.task == "score") != (self.pair_column is not None):
            raise ValueError("score needs pair_column (the second text of each pair); only score")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)}")


_OPTION_NAMES = frozenset(f.name for f in fields(PredictorOptions))


class Predictor:
    """A callable class for `Dataset.map_batches`: one engine per actor, loaded once.

    Batches may be pyarrow Tables (`batch_format="pyarrow"`, what the helpers use: columns pass
    through without a copy) or dicts of numpy arrays (Ray's default); the answer has the same
    kind, with the output and error columns added.
    """

    @fields_as_keywords(PredictorOptions, hide_var_keyword=True)
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        num_threads: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """`options`: the fields of `PredictorOptions`."""
        self.options = PredictorOptions(**options)
        self.output_column = self.options.output_column or DEFAULT_OUTPUT_COLUMNS[self.task]
        self.llm = _load_engine(model, num_threads, engine_kwargs or {})
        self.pooling_params = self._pooling_params()
        self._width: int | None = None

    @property
    def task(self) -> str:
        return self.options.task

    def _pooling_params(self) -> Any:
        from tidepool.params import PoolingParams

        if self.task != "embed":
            return None
        return PoolingParams(
            dimensions=self.options.dimensions, use_activation=self.options.normalize
        )

    def __call__(self, batch: pa.Table | dict[str, np.ndarray]) -> pa.Table | dict[str, Any]:
        columns = _column_names(batch)
        error_column_name = self.options.error_column
        for name in (self.output_column, error_column_name):
            if name in columns:
                raise ValueError(
                    f"the batch already has a column {name!r}; choose another output_column / "
                    "error_column"
                )
        rows = self.pool(_values(batch, self.options.column), self._pairs(batch))
        output = arrow_column(rows, self.options.output_dtype, self.output_width(rows))
        errors = error_column(rows)
        if isinstance(batch, dict):
            return {**batch, self.output_column: output, error_column_name: errors}
        return batch.append_column(self.output_column, output).append_column(
            error_column_name, errors
        )

    def pool(self, texts: list[Any], pairs: list[Any] | None = None) -> PooledRows:
        """The task over one batch of values (the CLI's Ray job calls this directly)."""
        if not texts:
            return PooledRows(np.zeros((0, self._width or 0), dtype=np.float32), [])
        return pool_rows(
            self.llm,
            self.task,
            texts,
            pairs,
            pooling_params=self.pooling_params,
            truncate_prompt_tokens=self.options.truncate_prompt_tokens,
        )

    def _pairs(self, batch: pa.Table | dict[str, np.ndarray]) -> list[Any] | None:
        pair_column = self.options.pair_column
        return None if pair_column is None else _values(batch, pair_column)

    def output_width(self, rows: PooledRows) -> int:
        """Every batch must give the same schema, even one in which every row failed."""
        if rows.values.ndim == 1:
            return 0
        if rows.values.shape[1]:
            self._width = rows.values.shape[1]
        elif self._width is None:
            probe = self.pool(["width probe"])  # only embed / classify get here
            self._width = probe.values.shape[1]
        return self._width


def _load_engine(model: str, num_threads: int | None, engine_kwargs: dict[str, Any]) -> Any:
    import torch

    from tidepool import LLM

    if num_threads is not None:
        # The tokenizer's Rust thread pool reads this when it first starts: keep it to the
        # actor's share of the node, as torch's pool is below.
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))
    llm = LLM(model, **engine_kwargs)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return llm


def _column_names(batch: Any) -> list[str]:
    if isinstance(batch, dict):
        return list(batch)
    if hasattr(batch, "column_names"):
        return list(batch.column_names)
    raise TypeError(
        f"batches must be pyarrow Tables or dicts of numpy arrays, got {type(batch).__name__}; "
        "pass batch_format='pyarrow' to map_batches"
    )


def _values(batch: Any, column: str) -> list[Any]:
    if column not in _column_names(batch):
        raise KeyError(f"the batch has no column {column!r}; columns: {_column_names(batch)}")
    values = batch[column]
    # numpy str_ / object arrays and Arrow columns both become plain Python values.
    return values.tolist() if isinstance(values, np.ndarray) else values.to_pylist()


# ---------------------------------------------------------------------- dataset helpers


def embed_dataset(
    ds: Dataset,
    model: str = DEFAULT_MODEL,
    *,
    column: str = "text",
    output_column: str = "embedding",
    dimensions: int | None = None,
    normalize: bool | None = None,
    **options: Any,
) -> Dataset:
    """`ds` with an embedding column (float32 lists; null + `error` for bad rows).

    Options: `concurrency` (actors, an int or (min, max); default 1), `num_cpus` (per actor,
    default 1; the engine uses as many threads), `batch_size` (rows per call, default 256),
    `error_column`, `output_dtype`, `truncate_prompt_tokens` (default -1: cut to the model's
    maximum), `engine_kwargs` (LLM's arguments: dtype, max_num_seqs, ...), and anything else
    `map_batches` takes (e.g. `max_restarts`, `max_task_retries`, `memory`).
    """
    return map_dataset(
        ds,
        model,
        task="embed",
        column=column,
        output_column=output_column,
        dimensions=dimensions,
        normalize=normalize,
        **options,
    )


def classify_dataset(
    ds: Dataset, model: str, *, column: str = "text", output_column: str = "probs", **options: Any
) -> Dataset:
    """`ds` with a `probs` column (class probabilities); options as `embed_dataset`."""
    return map_dataset(
        ds, model, task="classify", column=column, output_column=output_column, **options
    )


def score_dataset(
    ds: Dataset,
    model: str,
    *,
    column: str = "text_1",
    pair_column: str = "text_2",
    output_column: str = "score",
    **options: Any,
) -> Dataset:
    """`ds` with a `score` column: the relevance of each (column, pair_column) row; a
    cross-encoder reads the pair, an embedding model gives the cosine. Options as `embed_dataset`."""
    return map_dataset(
        ds,
        model,
        task="score",
        column=column,
        pair_column=pair_column,
        output_column=output_column,
        **options,
    )


@fields_as_keywords(PredictorOptions)
def map_dataset(
    ds: Dataset,
    model: str = DEFAULT_MODEL,
    *,
    concurrency: int | tuple[int, int] = 1,
    num_cpus: float = 1,
    batch_size: int = 256,
    engine_kwargs: dict[str, Any] | None = None,
    **map_batches_kwargs: Any,
) -> Dataset:
    """`ds.map_batches(Predictor, ...)` on a pool of `concurrency` actors, one engine each.
    `map_batches_kwargs` may hold the fields of `PredictorOptions` too: they go to each actor's
    Predictor (checked here, before any actor starts), the rest to `map_batches`.

    Ray Data gives actor-pool actors `max_restarts=-1` and `max_task_retries=-1`: an actor that
    dies is restarted and its batch runs again. Pass finite ones (to `map_batches`) to give up
    instead.
    """
    from ray.data import ActorPoolStrategy

    options = {
        name: map_batches_kwargs.pop(name)
        for name in list(map_batches_kwargs)
        if name in _OPTION_NAMES
    }
    PredictorOptions(**options)
    if isinstance(concurrency, int):
        compute = ActorPoolStrategy(size=concurrency)
    else:
        compute = ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    predictor_kwargs = {
        "model": model,
        **options,
        # One torch thread per reserved CPU: more would fight the node's other actors.
        "num_threads": max(1, int(num_cpus)),
        "engine_kwargs": engine_kwargs,
    }
    return ds.map_batches(
        Predictor,
        fn_constructor_kwargs=predictor_kwargs,
        compute=compute,
        num_cpus=num_cpus,
        batch_size=batch_size,
        batch_format="pyarrow",
        **map_batches_kwargs,
    )
