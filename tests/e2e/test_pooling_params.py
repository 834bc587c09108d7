"""Per-request pooling parameters on the real all-MiniLM-L6-v2 (which ends in Normalize)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import RobertaConfig

from tidepool import PoolingParams
from tidepool.models.bert import roberta_position_offset

TEXTS = ["a tide pool at dawn", "matryoshka dolls nest inside each other", "x"]


def _embed(llm, params: PoolingParams) -> torch.Tensor:
    outs = llm.embed(TEXTS, pooling_params=params, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_dimensions_truncates_then_renormalizes(minilm_llm):
    raw = _embed(minilm_llm, PoolingParams(normalize=False))
    assert not torch.allclose(raw.norm(dim=1), torch.ones(len(TEXTS)))  # really unnormalized
    short = _embed(minilm_llm, PoolingParams(dimensions=64))
    assert short.shape == (len(TEXTS), 64)
    assert torch.allclose(short, F.normalize(raw[:, :64], dim=1), atol=1e-6)


def test_explicit_normalize_false_wins_over_dimensions(minilm_llm):
    raw = _embed(minilm_llm, PoolingParams(normalize=False))
    short_raw = _embed(minilm_llm, PoolingParams(dimensions=64, normalize=False))
    assert torch.allclose(short_raw, raw[:, :64], atol=1e-6)


def test_roberta_offset_respects_a_pad_id_of_zero():
    assert roberta_position_offset(RobertaConfig(pad_token_id=1)) == 2
    assert roberta_position_offset(RobertaConfig(pad_token_id=0)) == 1
