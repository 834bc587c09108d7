"""The transformers backend proves itself at load: its model against Hugging Face's, same weights.

An encoder that the backend can plug into (transformers_backend/backend.py) may still compute
something else than transformers does: a mask the model builds at call time, a causal flag, a
position the packed batch gets wrong, an embedding module that sees the packed length. So before
the checkpoint is read, one tiny forward decides (transformers_backend/fallback.py: fallback_if_backend_fails):

    the backend's model, built without the checkpoint, parameters filled from a seeded generator
      ├─ tidepool's path: two sequences of different lengths packed in one step (8 and 5 tokens),
      │  through tidepool's attention (the backend the loader picked here), the model's own
      │  embedding pooling where it has one (CLIP: EOS token, projection)
      └─ transformers' path: each sequence alone through the same HF modules with
         attn_implementation="eager" (transformers' own attention and masks, its own positions)
    max |difference| > float32 bound x max |reference|  →  a disagreement (returned as text)

The bound is the one tests/tolerances.py derives: rtol = 96 * depth * sqrt(n) * u, depth = the
attention layers + 1, n = the longest reduction (hidden, intermediate, tokens), u = 2**-24
(2**-11 where CUDA float32 matmuls run as TF32). The check runs in float32 whatever the model's
dtype (the mask and position logic it checks does not depend on it; a half-precision bound would
be too loose to see anything). The random parameters make attention far from uniform (q.k of unit
scale), so a dropped mask moves outputs by ~1e-1, the bound is ~1e-4 to 1e-3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tidepool.attention.common import encoder_step
from tidepool.config import ModelConfig
from tidepool.models.interfaces import EmbeddingPoolingHead
from tidepool.transformers_backend.backend import build_transformers_model
from tidepool.transformers_backend.wrappers import attention_modules

CHECK_LENGTHS = (8, 5)
"""The two packed sequences (longest first, as the runner orders a step)."""
_SAFETY = 96  # tests/tolerances.py: 2 sides x 8 reductions per layer x lambda 6
_SEED = 0


def check_backend(config: ModelConfig) -> str | None:
    """None when the backend's encoder equals transformers' on two packed sequences; else why
    not. Raises what the backend's forward raises (an attention feature it refuses)."""
    generator = torch.Generator().manual_seed(_SEED)
    seqs = [_token_ids(config.hf_config, n, generator) for n in CHECK_LENGTHS]
    used = torch.cat(seqs).unique()
    check_config = dataclasses.replace(config, dtype=torch.float32)
    model = build_transformers_model(
        check_config, with_weights=False, fill=lambda m: _fill_parameters(m, used)
    )
    with torch.inference_mode():
        return _compare(model, model.hf_model, [s.to(config.device) for s in seqs], config)


def dry_forward(model: nn.Module, config: ModelConfig) -> None:
    """8 tokens through the encoder (and its classifier head), as the runner calls them: that
    it runs in the model's dtype (the comparison ran in float32)."""
    ids = _token_ids(config.hf_config, 8, torch.Generator().manual_seed(_SEED)).to(config.device)
    positions = torch.arange(8, device=config.device)
    step = encoder_step([8], config.device, config.dtype, _heads(config))
    meta = model.attention_backend.metadata_builder().build(step)
    with torch.inference_mode():
        hidden = model(ids, positions, meta)
        if config.task == "classify" and config.output_head == "task":
            model.compute_logits(hidden[:1])  # type: ignore[operator]


def _compare(
    model: Any, hf_model: nn.Module, seqs: list[torch.Tensor], config: ModelConfig
) -> str | None:
    device = config.device
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n, device=device) for n in CHECK_LENGTHS])
    step = encoder_step(list(CHECK_LENGTHS), device, torch.float32, _heads(config))
    ours = model(ids, positions, model.attention_backend.metadata_builder().build(step))
    pooled = None
    if config.task == "embed" and isinstance(model, EmbeddingPoolingHead):
        pooled = model.pool_embeddings(ours, step.query_start_loc.to(device), ids)
    if config.task == "classify" and config.output_head == "task":
        model.compute_logits(ours[:1])  # the head runs on our pooled states (HF's code)
    with _eager_attention(hf_model):
        theirs = torch.cat([_reference_states(hf_model, s) for s in seqs])
        their_pooled = None
        if pooled is not None:
            their_pooled = torch.cat([_reference_embedding(hf_model, s) for s in seqs])
    depth = len(attention_modules(hf_model)) + 1
    hf_config = hf_model.config
    reduction = max(
        int(getattr(hf_config, "hidden_size", 0) or 0),
        int(getattr(hf_config, "intermediate_size", 0) or 0),
        sum(CHECK_LENGTHS),
    )
    rtol = _SAFETY * depth * math.sqrt(reduction) * _unit_roundoff(device)
    what = f"on {len(CHECK_LENGTHS)} packed sequences of {' and '.join(map(str, CHECK_LENGTHS))}"
    found = _disagreement("token states", ours, theirs, rtol)
    if found is None and pooled is not None and their_pooled is not None:
        found = _disagreement("pooled embeddings", pooled, their_pooled, rtol)
    if found is None:
        return None
    return (
        f"the transformers backend disagrees with transformers' own attention at load ({found} "
        f"{what} tokens, random weights)"
    )


def _disagreement(name: str, ours: torch.Tensor, theirs: torch.Tensor, rtol: float) -> str | None:
    if ours.shape != theirs.shape:
        return f"{name} of shape {tuple(ours.shape)}, transformers' {tuple(theirs.shape)}"
    theirs = theirs.to(ours.dtype)
    if not torch.isfinite(theirs).all():
        return None  # the random weights overflowed transformers' own run: nothing to compare
    magnitude = float(theirs.abs().max())
    diff = float((ours - theirs).abs().max()) if torch.isfinite(ours).all() else math.inf
    bound = rtol * max(magnitude, torch.finfo(torch.float32).tiny)
    if diff <= bound:
        return None
    return f"{name}: max abs diff {diff:.3g} > float32 bound {bound:.3g}"


def _reference_states(hf_model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The body's last hidden state of one sequence, as transformers runs it."""
    out = hf_model.base_model(input_ids=ids[None])
    states = out[0] if isinstance(out, tuple) else out.last_hidden_state
    return states[0]


def _reference_embedding(hf_model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own embedding of one sequence (CLIP: text_embeds, else pooler_output)."""
    out = hf_model(input_ids=ids[None])
    embeds = getattr(out, "text_embeds", None)
    return out.pooler_output if embeds is None else embeds


@contextlib.contextmanager
def _eager_attention(hf_model: nn.Module) -> Iterator[None]:
    """transformers' eager attention (and the masks it builds for it) in every submodel."""
    configs = {id(m.config): m.config for m in hf_model.modules() if _has_config(m)}
    before = {key: c._attn_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = "eager"
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = before[key]


def _has_config(module: nn.Module) -> bool:
    from transformers import PretrainedConfig

    return isinstance(getattr(module, "config", None), PretrainedConfig)


def _fill_parameters(hf_model: nn.Module, used_ids: torch.Tensor) -> None:
    """Seeded values of unit-scale activations, written in place: matrices uniform with variance
    1/fan_in, so q.k / sqrt(d) is of unit scale and attention is far from uniform; 1-D weights
    (norm scales) 1 +- 0.2, other 1-D parameters (biases) +- 0.2. Of the token embeddings only
    the rows of `used_ids` (the rest is never read: a 250k-word vocabulary stays untouched).
    Buffers (RoPE frequencies, position ids) stay.

    The values come from one seeded pool of _POOL uniform numbers (a prime count), each
    parameter reading it from its own offset, wrapping around: a copy per element instead of a
    random draw (an order of magnitude faster for BERT-base's 86M parameters)."""
    device = next(hf_model.parameters()).device
    generator = torch.Generator().manual_seed(_SEED)
    pool = (torch.rand(_POOL, generator=generator) * 2 - 1).to(device)  # U(-1, 1)
    tokens = _input_embedding_weight(hf_model)
    with torch.no_grad():
        for index, (name, param) in enumerate(hf_model.named_parameters()):
            offset = (index * 7_919 * 104_729) % _POOL
            if param is tokens:
                rows = torch.empty(len(used_ids), param.shape[1], device=device)
                _copy_from_pool(rows, pool, offset, math.sqrt(3.0 / param.shape[1]))
                param[used_ids.to(device)] = rows
            elif param.dim() > 1:
                _copy_from_pool(param, pool, offset, math.sqrt(3.0 / param.shape[-1]))
            elif name.endswith("weight"):
                _copy_from_pool(param, pool, offset, 0.2)
                param.add_(1.0)
            else:
                _copy_from_pool(param, pool, offset, 0.2)


_POOL = 1_000_003


def _copy_from_pool(target: torch.Tensor, pool: torch.Tensor, offset: int, scale: float) -> None:
    """target's elements ← scale * pool, read from `offset` on and wrapping around."""
    flat = target.view(-1)
    start = 0
    while start < flat.numel():
        n = min(flat.numel() - start, _POOL - offset)
        torch.mul(pool[offset : offset + n], scale, out=flat[start : start + n])
        start, offset = start + n, 0


def _input_embedding_weight(hf_model: nn.Module) -> torch.Tensor | None:
    try:
        embeddings = hf_model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    weight = getattr(embeddings, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _token_ids(hf_config: Any, length: int, generator: torch.Generator) -> torch.Tensor:
    """Ids from the vocabulary, never the pad id (RoBERTa-like models number positions from
    it); the last one the EOS id where the config has one (CLIP pools there)."""
    vocab = int(getattr(hf_config, "vocab_size", 0) or 2)
    ids = torch.randint(0, vocab, (length,), generator=generator)
    pad = getattr(hf_config, "pad_token_id", None)
    if isinstance(pad, int):
        ids = torch.where(ids == pad, (pad + 1) % vocab, ids)
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int) and 0 <= eos < vocab and eos != pad:
        ids[-1] = eos
    return ids


def _heads(config: ModelConfig) -> int:
    return int(getattr(config.hf_config, "num_attention_heads", None) or 1)


def _unit_roundoff(device: torch.device) -> float:
    """float32's, unless CUDA runs float32 matmuls as TF32 (10-bit mantissa) or bfloat16."""
    if device.type == "cuda":
        precision = torch.get_float32_matmul_precision()
        if precision == "medium":
            return 2.0**-8
        if precision == "high" or torch.backends.cuda.matmul.allow_tf32:
            return 2.0**-11
    return 2.0**-24
