"""Adding an attention backend is one module plus one registry entry: a toy backend
(tests/reference_attention.py, per-sequence float64 attention with its own metadata builder and
its own page-major KV-cache layout) registered from here runs a tiny encoder and tiny decoders
(paged, hybrid sliding window, chunked prefill, prefix caching) through the engine, equal to the
default backends within the float32 bound."""

from __future__ import annotations

import pytest
import torch
from reference_attention import REFERENCE_DECODER, REFERENCE_ENCODER
from tolerances import assert_close

from tidepool import LLM, PoolingParams, SamplingParams
from tidepool.attention import backend
from tidepool.attention.common import CommonAttentionMetadata, encoder_step

RAW = PoolingParams(normalize=False)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "Hello world!",
    "Chunked prefill splits a long prompt over several engine steps. " * 5,
]


@pytest.fixture
def reference_backends(monkeypatch):
    """The toy backends at the front of both registries (the registry entry), for this test."""
    monkeypatch.setattr(backend, "ENCODER_BACKENDS", dict(backend.ENCODER_BACKENDS))
    monkeypatch.setattr(backend, "DECODER_BACKENDS", dict(backend.DECODER_BACKENDS))
    backend.register_encoder_backend(REFERENCE_ENCODER)
    backend.register_decoder_backend(REFERENCE_DECODER)
    yield


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    outputs = llm.embed(texts, pooling_params=RAW, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_registering_refuses_a_second_backend_of_the_same_name(reference_backends):
    with pytest.raises(ValueError, match="reference_float64"):
        backend.register_encoder_backend(REFERENCE_ENCODER)
    assert list(backend.ENCODER_BACKENDS)[0] == "reference_float64"
    assert list(backend.DECODER_BACKENDS)[-1] == "paged_sdpa"


@pytest.mark.parametrize("kind", ["bert", "bert-mean"])
def test_a_registered_backend_runs_an_encoder(tiny_model_path, reference_backends, kind):
    path = str(tiny_model_path(kind))
    reference = LLM(path, device="cpu", dtype="float32")
    runner = reference.engine.model_runner
    assert runner.model.attention_backend is REFERENCE_ENCODER  # the registry's pick, at load
    expected_meta = runner.attn_builder.build(
        encoder_step([3, 2], torch.device("cpu"), torch.float32)
    )
    assert expected_meta.starts == [0, 3] and expected_meta.key_lens == [3, 2]
    ours = _embed(reference, TEXTS)
    del reference
    backend.ENCODER_BACKENDS.pop(REFERENCE_ENCODER.name)
    default = LLM(path, device="cpu", dtype="float32")
    assert default.engine.model_runner.model.attention_backend is not REFERENCE_ENCODER
    expected = _embed(default, TEXTS)
    hidden = default.engine.model_runner.model.config.hidden_size
    assert (expected[0] - expected[1]).abs().max() > 1e-3
    assert_close(ours, expected, depth=3, reduction=hidden, dim=-1)


DECODER_OPTIONS = [
    {},
    {"max_num_batched_tokens": 24},  # chunked prefill: prompts over several steps
    {"enable_prefix_caching": False},
]


@pytest.mark.parametrize("kind", ["llama", "qwen2-hybrid"])
@pytest.mark.parametrize("options", DECODER_OPTIONS, ids=["default", "chunked", "no-prefix"])
def test_a_registered_backend_runs_a_decoder(tiny_decoder_path, reference_backends, kind, options):
    path = str(tiny_decoder_path(kind))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    # The shared prefix is computed once and read from the cache by the later prompts.
    prompts = [TEXTS[3] + t for t in TEXTS]

    def generate(llm: LLM):
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]  # 2nd: cached
        return [o.outputs[0] for run in runs for o in run]

    reference = LLM(path, device="cpu", dtype="float32", **options)
    runner = reference.engine.model_runner
    assert runner.model.attention_backend is REFERENCE_DECODER
    assert runner.kv_caches[0].shape[2] == 2  # the backend's page-major layout
    ours = generate(reference)
    del reference
    backend.DECODER_BACKENDS.pop(REFERENCE_DECODER.name)
    default = LLM(path, device="cpu", dtype="float32", **options)
    assert default.engine.model_runner.kv_caches[0].shape[0] == 2  # head-major
    expected = generate(default)
    for a, b in zip(ours, expected, strict=True):
        assert a.token_ids == b.token_ids
        got = torch.tensor([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids, strict=True)])
        want = torch.tensor([lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids, strict=True)])
        assert_close(got, want, depth=4, reduction=64, scale=1.0)


def test_a_backend_cannot_change_the_cache_layout_after_load(tiny_decoder_llm):
    llm = tiny_decoder_llm("llama")
    runner = llm.engine.model_runner
    model = runner.model
    chosen = model.attention_backend
    try:
        model.set_attention_backend(REFERENCE_DECODER)
        with pytest.raises(ValueError, match="lays the KV cache out"):
            runner.attn_builder  # noqa: B018
    finally:
        model.set_attention_backend(chosen)
    assert runner.attn_builder.in_place_decode_len >= 0  # the default's builder again


def test_the_step_description_is_neutral():
    step = encoder_step([4, 2], torch.device("cpu"), torch.float32, key_lens=[3, 2])
    assert isinstance(step, CommonAttentionMetadata)
    assert step.query_start_loc.tolist() == [0, 4, 6] and step.num_tokens == 6
    assert step.context_lens == [0, 0] and not step.causal and step.kv_groups == ()
