"""`vllm.sampling_params`'s path: SamplingParams and RequestOutputKind live in
tidepool/params.py."""

from tidepool.params import RequestOutputKind, SamplingParams

__all__ = ["RequestOutputKind", "SamplingParams"]
