"""Checkpoint tensors → a model's parameters, where one of ours fuses several checkpoint tensors.

    checkpoint                          ours: rows of the fused parameter (shard 0, 1, 2)
    layers.0.self_attn.q_proj.weight →  layers.0.self_attn.qkv_proj.weight  [0, q)
    layers.0.self_attn.k_proj.weight →  layers.0.self_attn.qkv_proj.weight  [q, q + kv)
    layers.0.self_attn.v_proj.weight →  layers.0.self_attn.qkv_proj.weight  [q + kv, q + 2 kv)

(q, kv: the rows of the query and of the key / value projections.)

A model gives the marker table (".q_proj." → (".qkv_proj.", 0), ...) and the rows of each shard of
a fused parameter; every other tensor is copied as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

FusedMarkers = Mapping[str, tuple[str, int]]
"""Checkpoint name part → (the fused parameter's name part, shard index); shards lie in index
order along dim 0."""


def qkv_markers(attention: str, query: str, key: str, value: str) -> FusedMarkers:
    """The marker table of an encoder whose `attention` module holds `query`, `key` and `value`
    linears, fused as its `qkv` (rows in that order): BERT's, DeBERTa's, T5's."""
    return {
        f"{attention}{name}.": (f"{attention}qkv.", index)
        for index, name in enumerate((query, key, value))
    }


def equal_thirds(module: nn.Module, fused_name: str) -> list[int]:
    """Rows of the query, key and value shards of a fused `qkv` parameter (equal heads)."""
    rows = module.get_parameter(fused_name).shape[0]
    return [rows // 3] * 3


def load_fused_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], str | None],
    fused_markers: FusedMarkers,
    shard_sizes: Callable[[nn.Module, str], list[int]],
) -> set[str]:
    """Copy checkpoint tensors into `module`: `map_name` gives our name (None: not ours), a name
    with a marker of `fused_markers` goes into its shard of the fused parameter, whose shards have
    `shard_sizes(module, fused_name)` rows.

    Returns the loaded parameter names; raises if a parameter is left without weights.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    shards_loaded: dict[str, set[int]] = {}
    for ckpt_name, tensor in weights:
        name = map_name(ckpt_name)
        if name is None:
            continue
        shard = None
        for marker, (fused, index) in fused_markers.items():
            if marker in name:
                name, shard = name.replace(marker, fused), index
                break
        param = params.get(name)
        if param is None:
            continue
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{ckpt_name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(name)
                continue
            sizes = shard_sizes(module, name)
            offset = sum(sizes[:shard])
            if tensor.shape[0] != sizes[shard]:
                raise ValueError(f"{ckpt_name}: {tensor.shape[0]} rows, expected {sizes[shard]}")
            param[offset : offset + sizes[shard]].copy_(tensor)
            shards_loaded.setdefault(name, set()).add(shard)
            if len(shards_loaded[name]) == len(sizes):
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"the checkpoint has no weights for {len(missing)} parameters: {missing[:8]}"
        )
    return loaded
