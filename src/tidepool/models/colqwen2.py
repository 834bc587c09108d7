"""ColQwen2 (`ColQwen2ForRetrieval`): Qwen2-VL's body, then one projected vector per token.

    vlm (models/qwen2_vl.py) → last hidden states [T, hidden] → embedding_proj_layer → [T, dim]

The "colvision" output head (output_heads/colvision.py) normalizes each vector and serves
token_embed; score / rerank take MaxSim of query and page vectors.

Positions: transformers' ColQwen2 hands its VLM input embeddings without input ids, so the VLM
cannot compute M-RoPE's image rows and rotates plain positions 0..T-1 (three equal rows) for
image prompts too; tidepool matches it (vLLM 0.32 runs ColQwen2 with M-RoPE: its page vectors
differ from transformers').
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tidepool.models.layers.linear import Linear
from tidepool.models.qwen2_vl import Qwen2VLModel


class ColQwen2ForRetrieval(Qwen2VLModel):
    uses_mrope: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        super().__init__(config.vlm_config)
        self.retrieval_config = config
        self.embedding_dim = int(config.embedding_dim)
        hidden = config.vlm_config.text_config.hidden_size
        self.embedding_proj_layer = Linear(hidden, self.embedding_dim)

    def compute_token_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden] → [num_tokens, embedding_dim] (not normalized)."""
        return self.embedding_proj_layer(hidden)

    def map_weight_name(self, name: str) -> str | None:
        name = name.removeprefix("vlm.")
        if name.startswith("embedding_proj_layer."):
            return name
        return super().map_weight_name(name)
