"""Scale-out on Ray: batch jobs on Ray Data, serving replicas on Ray Serve.

    tidepool.ray.Predictor        callable class for Dataset.map_batches (one engine per actor)
    tidepool.ray.embed_dataset    ds → ds + embedding / error columns (classify_dataset,
                                  score_dataset, map_dataset likewise)
    tidepool.jobs.ray_runner      `tidepool embed --ray`: files in, parquet files out, resumable
    tidepool.ray.pool_rows        rows through any `OfflineLLM` (ray/pooling.py), bad rows as errors
    tidepool.entrypoints.ray_serve  N replicas of the OpenAI-compatible server on Ray Serve

ray/ sits below jobs/ (whose Ray runner maps shards with the Predictor) and entry points: it
imports neither.

The engine stays a single-process library; Ray runs many of them (see docs/ray.md). Needs
`pip install 'tidepool[ray]'`; importing this package does not import Ray.
"""

from __future__ import annotations

from tidepool.ray.data import (
    PooledRows,
    Predictor,
    classify_dataset,
    embed_dataset,
    map_dataset,
    pool_rows,
    score_dataset,
)

__all__ = [
    "PooledRows",
    "Predictor",
    "classify_dataset",
    "embed_dataset",
    "map_dataset",
    "pool_rows",
    "score_dataset",
]
