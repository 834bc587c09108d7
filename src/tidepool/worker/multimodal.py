"""The runner's multi-modal half: the encoder cache, the scatter into the step's embeddings,
and the image requests of dual-tower models.

    a step's scheduled tokens [c, c + q) of each request
        │  the features whose placeholders they touch (MultiModalFeature.overlap)
        ▼
    EncoderCache: request id → {feature index → rows [length, hidden]}
        │  the missing ones encoded together: one model.embed_multimodal call per step
        ▼
    inputs_embeds = model.embed_input_ids(input_ids); rows copied at their flat positions
        │  → model.forward(..., inputs_embeds=inputs_embeds)
        ▼
    an item leaves the cache once the request has computed all its placeholders (or finishes),
    so a prompt chunked across steps encodes each image once, and a prefix-cache hit that
    covers an image never encodes it.

Dual-tower models (CLIP, SigLIP: models/interfaces.py DualTowerModel): an image request's
prompt is its placeholders alone; the step's image requests go through `pool_multimodal`
together (the vision tower packed) and the pooler's finishing (normalize, dimensions), the
text requests through the text tower as any encoder's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidepool.models.interfaces import DualTowerModel, MultiModalModel
from tidepool.multimodal.features import MultiModalFeature
from tidepool.request import Request
from tidepool.utils.lists import filled
from tidepool.worker.pooler import Pooler


class MultiModalRunner:
    def __init__(self, model: MultiModalModel | DualTowerModel, pooler: Pooler) -> None:
        self.model = model
        self.pooler = pooler
        self.cache: dict[str, dict[int, torch.Tensor]] = {}
        """request id → {index in its mm_features → the encoder's rows}."""
        self.num_encoded = 0
        """Items encoded so far (each once per request: the tests read it)."""

    @staticmethod
    def for_model(model: object, pooler: Pooler) -> MultiModalRunner | None:
        """The hook for a model that takes images, None for a text-only one."""
        if isinstance(model, (MultiModalModel, DualTowerModel)):
            return MultiModalRunner(model, pooler)
        return None

    # ------------------------------------------------------------------ dual towers

    def pool_image_requests(
        self, requests: list[Request]
    ) -> tuple[list[Request], dict[str, torch.Tensor]]:
        """(the text requests, the image requests' finished embeddings): a dual-tower model's
        image requests run its vision side, all of the step's in one call."""
        if not isinstance(self.model, DualTowerModel):
            return requests, {}
        images = [r for r in requests if r.mm_features]
        if not images:
            return requests, {}
        rows = self.model.pool_multimodal([r.mm_features[0] for r in images])
        self.num_encoded += len(images)
        params = filled([r.pooling_params for r in images])
        rows = rows.float()
        pooled = {
            r.request_id: self.pooler.finish_embedding(row, p).cpu()
            for r, row, p in zip(images, rows, params, strict=True)
        }
        return [r for r in requests if not r.mm_features], pooled

    # ------------------------------------------------------------------ placeholders

    def inputs_embeds(
        self,
        input_ids: torch.Tensor,
        requests: Sequence[Request],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> torch.Tensor | None:
        """The step's input embeddings with every scheduled placeholder's encoder row, or None
        when the step schedules no placeholder. Requests are in flat order: request i holds
        flat tokens [sum(query_lens[:i]), + query_lens[i]), prompt positions [c_i, c_i + q_i)."""
        touched = []
        for i, (request, c, q) in enumerate(zip(requests, context_lens, query_lens, strict=True)):
            for j, feature in enumerate(request.mm_features):
                if (part := feature.overlap(c, c + q)) is not None:
                    touched.append((i, j, part))
        if not touched:
            return None
        assert isinstance(self.model, MultiModalModel)  # a dual tower's prompts are all images
        self._encode_missing([(requests[i], j) for i, j, _ in touched])
        embeds = self.model.embed_input_ids(input_ids)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        for i, j, (lo, hi) in touched:
            request, c = requests[i], context_lens[i]
            feature = request.mm_features[j]
            rows = self.cache[request.request_id][j]
            flat = starts[i] + lo - c
            embeds[flat : flat + hi - lo] = rows[lo - feature.offset : hi - feature.offset]
            if hi == feature.end:  # its last placeholder is computed now
                self._drop(request.request_id, j)
        return embeds

    def _encode_missing(self, items: list[tuple[Request, int]]) -> None:
        missing: dict[tuple[str, int], MultiModalFeature] = {}
        for request, j in items:
            if j not in self.cache.get(request.request_id, {}):
                missing[(request.request_id, j)] = request.mm_features[j]
        if not missing:
            return
        assert isinstance(self.model, MultiModalModel)
        outputs = self.model.embed_multimodal(list(missing.values()))
        if len(outputs) != len(missing):
            raise ValueError(
                f"{type(self.model).__name__}.embed_multimodal returned {len(outputs)} items "
                f"for {len(missing)}"
            )
        self.num_encoded += len(missing)
        for ((request_id, j), feature), rows in zip(missing.items(), outputs, strict=True):
            if rows.shape[0] != feature.length:
                raise ValueError(
                    f"{type(self.model).__name__}.embed_multimodal returned {rows.shape[0]} rows "
                    f"for an item of {feature.length} placeholders"
                )
            self.cache.setdefault(request_id, {})[j] = rows

    def _drop(self, request_id: str, index: int) -> None:
        items = self.cache.get(request_id)
        if items is not None:
            items.pop(index, None)
            if not items:
                del self.cache[request_id]

    def free(self, request_ids: set[str]) -> None:
        """Requests that finished or were aborted (or restart after preemption): drop theirs."""
        for request_id in request_ids:
            self.cache.pop(request_id, None)
