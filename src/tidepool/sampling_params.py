"""`vllm.sampling_params`'s path: SamplingParams lives in tidepool/params.py."""

from tidepool.params import SamplingParams

__all__ = ["SamplingParams"]
