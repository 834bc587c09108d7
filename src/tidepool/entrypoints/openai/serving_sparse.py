"""TEI's /embed_sparse over the shared checks of `OpenAIServing`:

    /embed_sparse  {"inputs": "text" | [...], "truncate": false, "prompt_name": null}
                   → [[{"index": token id, "value": weight}, ...], ...]   (TEI's shape)

The sparse and per-token response data every route shares are token_outputs.py's.
"""

from __future__ import annotations

from tidepool.entrypoints.openai import protocol_tei as pt
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.serving import OpenAIServing
from tidepool.entrypoints.openai.token_outputs import sparse_values


class OpenAIServingSparse:
    """TEI's /embed_sparse over the shared checks of `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def embed_sparse(self, req: pt.EmbedSparseRequest) -> pt.EmbedSparseResponse:
        serving = self.serving
        serving.model_name(req.model)
        serving.check_task("embed_sparse", "Sparse embeddings (/embed_sparse)")
        if req.truncation_direction.lower() != "right":
            raise ApiError(
                400, "truncation_direction Left is not supported", "truncation_direction"
            )
        outputs = await serving.encode_input(
            req.inputs,
            task="embed_sparse",
            truncate_prompt_tokens=-1 if req.truncate else None,
            max_active_dims=req.max_active_dims,
            prompt_name=req.prompt_name,
            param="inputs",
        )
        return pt.EmbedSparseResponse([sparse_values(o.outputs.data) for o in outputs])
