"""The step's M-RoPE positions for a model that declares them (models/interfaces.py MRopeModel).

Each request's three position rows are computed once, when a step first schedules it, from its
prompt length and its images' placeholder ranges and grids (models/mrope.py), and kept until it
finishes; a step reads the rows of each request's scheduled tokens [context, context + query):

    flat batch:   a (decode, index 40)   b (prefill chunk 0..15)
    positions:    [[40 + delta_a],        [rows of b's prompt, 0..15]]   → [3, num_tokens]

The 1D positions (slot mapping, attention lengths) are unchanged: only the rotary reads these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidepool.core.sched_output import SchedulerOutput
from tidepool.models.interfaces import MRopeModel
from tidepool.models.mrope import ImagePlacement, MRopePositions
from tidepool.request import Request


def image_placements(request: Request) -> list[ImagePlacement]:
    """The request's images as (offset, grid) pairs (their features' image_grid_thw)."""
    out = []
    for feature in request.mm_features:
        grid = feature.data.get("image_grid_thw")
        if grid is None:
            raise ValueError(f"image feature at {feature.offset} has no image_grid_thw (M-RoPE)")
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        out.append(ImagePlacement(feature.offset, (t, h, w)))
    return out


class MRopeStates:
    """request_id → its MRopePositions, in step with the scheduler's finished requests."""

    def __init__(self, model: MRopeModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.positions: dict[str, MRopePositions] = {}

    def step_positions(
        self,
        sched_out: SchedulerOutput,
        requests: Sequence[Request],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> torch.Tensor:
        """[3, num_tokens] int64 on the device: the flat batch's positions (its request order)."""
        for request_id in sched_out.finished_req_ids:
            self.positions.pop(request_id, None)
        parts = []
        for request, context, query in zip(requests, context_lens, query_lens, strict=True):
            rows = self.positions.get(request.request_id)
            if rows is None:
                found = self.model.mrope_positions(
                    request.num_prompt_tokens, image_placements(request)
                )
                assert found is not None  # uses_mrope: the runner asks only such models
                rows = self.positions[request.request_id] = found
            parts.append(rows.between(context, context + query))
        return torch.cat(parts, dim=1).to(self.device, non_blocking=True)
