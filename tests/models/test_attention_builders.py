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


# ------------------------------------------------- what a model needs beyond the kernel calls


@pytest.fixture(scope="module")
def tiny_deberta(tmp_path_factory, minilm_path):
    """A tiny DeBERTa-v3 embedder: its disentangled attention runs per padded bucket."""
    import transformers
    from conftest import copy_bert_tokenizer, write_st_pooling

    folder = tmp_path_factory.mktemp("deberta_needs")
    copy_bert_tokenizer(minilm_path, folder)
    torch.manual_seed(5)
    config = transformers.DebertaV2Config(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=16,
        type_vocab_size=0,
    )
    transformers.DebertaV2Model(config).eval().save_pretrained(str(folder))
    write_st_pooling(folder, "mean")
    return str(folder)


def test_the_registry_skips_a_backend_without_what_the_model_needs(
    tiny_deberta, reference_backends
):
    """DeBERTa's spec needs padded_buckets: with the toy backend (which provides nothing
    beyond its kernel calls) in front, the registry gives it bucketed SDPA, and the embeddings
    are those of the default registry (the same backend: equal to the bit)."""
    llm = LLM(tiny_deberta, device="cpu", dtype="float32")
    runner = llm.engine.model_runner
    assert runner.model.attention_backend is backend.BUCKETED_SDPA
    ours = _embed(llm, TEXTS)
    backend.ENCODER_BACKENDS.pop(REFERENCE_ENCODER.name)
    expected = _embed(LLM(tiny_deberta, device="cpu", dtype="float32"), TEXTS)
    assert torch.equal(ours, expected)
    # Handed the toy backend after load, the model is refused when the runner asks for the
    # builder (the next step), naming the model, what it needs and the backend, instead of
    # failing inside a layer.
    runner.model.set_attention_backend(REFERENCE_ENCODER)
    with pytest.raises(ValueError, match=r"DebertaV2Model needs attention padded_buckets.*'ref"):
        runner.attn_builder  # noqa: B018


def test_a_load_is_refused_when_no_backend_provides_what_the_model_needs(tiny_deberta, monkeypatch):
    monkeypatch.setattr(backend, "ENCODER_BACKENDS", {REFERENCE_ENCODER.name: REFERENCE_ENCODER})
    with pytest.raises(
        ValueError,
        match=r"DebertaV2Model needs \(padded_buckets\).*"
        r"registered: reference_float64",
    ):
        LLM(tiny_deberta, device="cpu", dtype="float32")


@pytest.mark.parametrize("window,needs", [(8, {"banded"}), (4096, set())])
def test_embedding_gemma_needs_banded_attention_only_past_its_window(
    reference_backends, window, needs
):
    """EmbeddingGemma's sliding layers attend in a band once a sequence passes the window:
    its spec needs banded attention then (the toy backend is skipped), and not when no
    sequence can (max_position_embeddings <= the window: the toy backend runs it)."""
    from transformers import Gemma3TextConfig

    from tidepool.models.gemma_embed import Gemma3TextEncoderModel
    from tidepool.models.interfaces import attach_attention_backend

    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        max_position_embeddings=512,
        use_bidirectional_attention=True,
    )
    model = Gemma3TextEncoderModel(config)
    cpu = torch.device("cpu")
    assert model.attention_spec(cpu, torch.float32).needs == needs
    attach_attention_backend(model, cpu, torch.float32)
    chosen = model.attention_backend
    assert (chosen is REFERENCE_ENCODER) == (not needs)
    assert needs <= chosen.provides


def test_a_spec_names_only_known_capabilities():
    from tidepool.attention.backend import AttentionSpec

    with pytest.raises(ValueError, match="unknown attention capabilities \\['flash'\\]"):
        AttentionSpec(torch.device("cpu"), torch.float32, 32, 512, needs=frozenset({"flash"}))
