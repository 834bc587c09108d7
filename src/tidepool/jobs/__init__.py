"""Batch jobs over files of texts: one row reader, one error policy, two runners.

    rows.py        what a line, a row and a bad row are (counting, planning, reading)
    formats.py     input / output formats, reading a local input
    writers.py     the local outputs and the errors file: how each survives a kill; .jsonl
    npy_writer.py, parquet_writer.py   the .npy and .parquet outputs
    durable.py     a chunk's result, the writer contract, atomic writes
    manifest.py    what an output is the output of (a rerun resumes only the same job), the lock
    pooling.py     one engine call over a batch of rows, bad rows as errors
    local.py       `tidepool embed`: the local runner on one engine
    plan.py        `tidepool embed --ray`: shards, the output folder, resuming
    ray_runner.py  `tidepool embed --ray`: the Ray runner
    demo.py        `tidepool embed --demo`

Runners take an engine (an object with `LLM`'s methods) or a model name; they never import
`tidepool.entrypoints`.
"""
