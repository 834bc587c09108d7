"""The model contracts (models/interfaces.py) and the attention backend registry
(attention/backend.py): which backend is picked for which case, that every backend gives a model
the same outputs, that the choice is made once at load, and that every model declares its
contract."""

from __future__ import annotations

import pytest
import torch
from conftest import copy_bert_tokenizer

from tidepool import LLM, PoolingParams, SamplingParams
from tidepool.attention import backend, cpu_kernels
from tidepool.attention.backend import (
    BUCKETED_SDPA,
    CPU_KERNEL,
    DECODER_BACKENDS,
    ENCODER_BACKENDS,
    PAGED_SDPA,
    AttentionSpec,
    select_decoder_backend,
    select_encoder_backend,
)
from tidepool.kernels import cpu_features
from tidepool.models.interfaces import (
    ClassifierHead,
    DecoderModel,
    EncoderModel,
    LanguageModelHead,
    LoadableModel,
)

ATOL = 1e-5
RAW = PoolingParams(normalize=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


# ----------------------------------------------------------------------------- selection


AVX512_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"})


@pytest.fixture
def kernel_machine(monkeypatch):
    """A machine where the CPU kernel would build (AVX-512, a compiler), without building it:
    the selection logic alone, independent of this machine."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: AVX512_FLAGS)
    monkeypatch.setattr(cpu_kernels, "_compile", lambda isa: f"the {isa} op")
    monkeypatch.delenv("TIDEPOOL_CPU_ATTENTION", raising=False)
    monkeypatch.delenv("TIDEPOOL_CPU_ISA", raising=False)
    cpu_features.reset()
    yield monkeypatch
    monkeypatch.undo()
    cpu_features.reset()


@pytest.mark.parametrize(
    "env,device,dtype,head_dim,max_positions,expected",
    [
        (None, CPU, F32, 32, 512, CPU_KERNEL),
        ("auto", CPU, BF16, 64, 512, CPU_KERNEL),
        ("auto", CPU, F32, 128, cpu_kernels.MAX_SEQ_LEN, CPU_KERNEL),
        ("native", CPU, F32, 32, 512, CPU_KERNEL),
        ("auto", CPU, F16, 32, 512, BUCKETED_SDPA),  # the kernel has no float16
        ("auto", CPU, F32, 48, 512, BUCKETED_SDPA),  # a head width it was not written for
        ("auto", CPU, F32, 16, 512, BUCKETED_SDPA),
        ("auto", CPU, F32, 64, cpu_kernels.MAX_SEQ_LEN + 1, BUCKETED_SDPA),  # [L, L] scores
        ("auto", CPU, F32, 64, 8192, BUCKETED_SDPA),
        ("auto", CUDA, F32, 64, 512, BUCKETED_SDPA),  # a GPU: not the CPU kernel
        ("native", CUDA, BF16, 64, 512, BUCKETED_SDPA),
        ("sdpa", CPU, F32, 32, 512, BUCKETED_SDPA),  # turned off
        ("SDPA", CPU, BF16, 64, 512, BUCKETED_SDPA),
    ],
)
def test_registry_picks_the_expected_encoder_backend(
    kernel_machine, env, device, dtype, head_dim, max_positions, expected
):
    if env is not None:
        kernel_machine.setenv("TIDEPOOL_CPU_ATTENTION", env)
    spec = AttentionSpec(device, dtype, head_dim, max_positions)
    assert select_encoder_backend(spec) is expected


def test_an_avx2_cpu_takes_the_avx2_build(kernel_machine):
    kernel_machine.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert select_encoder_backend(AttentionSpec(CPU, F32, 32, 512)) is CPU_KERNEL
    assert cpu_kernels.load() == "the avx2 op"


def test_without_avx2_or_a_compiler_encoders_keep_sdpa(kernel_machine):
    spec = AttentionSpec(CPU, F32, 32, 512)
    kernel_machine.setattr(cpu_features, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert select_encoder_backend(spec) is BUCKETED_SDPA
    kernel_machine.setattr(cpu_kernels, "_state", {})
    kernel_machine.setenv("TIDEPOOL_CPU_ATTENTION", "native")
    with pytest.raises(RuntimeError, match="TIDEPOOL_CPU_ATTENTION=native.*lacks avx2"):
        select_encoder_backend(spec)

    def no_compiler():
        raise FileNotFoundError("c++")

    kernel_machine.setattr(cpu_kernels, "_state", {})
    kernel_machine.setattr(cpu_features, "cpu_flags", lambda: AVX512_FLAGS)
    kernel_machine.setattr(cpu_kernels, "_compile", lambda isa: no_compiler())
    kernel_machine.setenv("TIDEPOOL_CPU_ATTENTION", "auto")
    assert select_encoder_backend(spec) is BUCKETED_SDPA


def test_registries_are_ordered_and_end_with_a_backend_for_every_spec():
    assert list(ENCODER_BACKENDS) == ["cpu_kernel", "bucketed_sdpa"]
    assert list(DECODER_BACKENDS) == ["paged_sdpa"]
    for spec in (AttentionSpec(CUDA, F16, 80, 32768), AttentionSpec(CPU, F32, 256, 131072)):
        assert list(ENCODER_BACKENDS.values())[-1].supports(spec)
        assert select_decoder_backend(spec) is PAGED_SDPA


# ----------------------------------------------------------------------------- same outputs


@pytest.fixture(scope="module")
def wide_head_bert(tmp_path_factory, minilm_path):
    """A tiny BERT with 32-wide heads (so that the CPU kernel can run it), saved for LLM."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("wide_head_bert")
    torch.manual_seed(7)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
    )
    BertModel(config).eval().save_pretrained(str(folder))
    copy_bert_tokenizer(minilm_path, folder)
    return folder


def _token_states(llm: LLM, texts: list[str]) -> list[torch.Tensor]:
    outs = llm.encode(texts, RAW, pooling_task="token_embed", use_tqdm=False)
    return [o.outputs.data for o in outs]


def _cls(llm: LLM, texts: list[str]) -> torch.Tensor:
    return torch.tensor(
        [o.outputs.embedding for o in llm.embed(texts, pooling_params=RAW, use_tqdm=False)]
    )


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_every_encoder_backend_gives_the_same_outputs(model_impl, wide_head_bert, tiny_texts):
    llm = LLM(str(wide_head_bert), device="cpu", dtype="float32", model_impl=model_impl)
    model = llm.engine.model_runner.model
    spec = model.attention_spec(CPU, F32)
    chosen = model.attention_backend
    assert chosen is select_encoder_backend(spec)  # the loader handed over the registry's pick
    runnable = [b for b in ENCODER_BACKENDS.values() if b.supports(spec)]
    if cpu_kernels.supports(CPU, F32, 32):
        assert chosen is CPU_KERNEL and len(runnable) == 2
    results = []
    try:
        for attention in runnable:
            model.set_attention_backend(attention)
            results.append((_token_states(llm, tiny_texts), _cls(llm, tiny_texts)))
    finally:
        model.set_attention_backend(chosen)
    first_states, first_cls = results[0]
    assert (first_cls[0] - first_cls[1]).abs().max() > 1e-3  # different texts, different outputs
    for states, cls in results[1:]:
        assert (cls - first_cls).abs().max() <= ATOL
        for a, b in zip(states, first_states, strict=True):
            assert (a - b).abs().max() <= ATOL


def test_every_decoder_backend_gives_the_same_tokens(tiny_decoder_llm):
    llm = tiny_decoder_llm("llama")
    model = llm.engine.model_runner.model
    chosen = model.attention_backend
    assert chosen is PAGED_SDPA
    prompts = ["The quick brown fox", "Paged attention stores keys and values"]
    outputs = []
    try:
        for attention in DECODER_BACKENDS.values():
            if attention.supports(model.attention_spec(CPU, F32)):
                model.set_attention_backend(attention)
                outputs.append(
                    [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                )
    finally:
        model.set_attention_backend(chosen)
    assert outputs and all(tokens == outputs[0] for tokens in outputs)


def test_the_backend_is_chosen_once_not_per_step(wide_head_bert, tiny_texts, monkeypatch):
    llm = LLM(str(wide_head_bert), device="cpu", dtype="float32")
    expected = _cls(llm, tiny_texts)

    def refuse(*args, **kwargs):
        raise AssertionError("the attention backend is selected per step")

    monkeypatch.setattr(cpu_kernels, "supports", refuse)
    monkeypatch.setattr(backend, "select_encoder_backend", refuse)
    for attention in ENCODER_BACKENDS.values():
        monkeypatch.setattr(type(attention), "supports", classmethod(refuse))
    assert (_cls(llm, tiny_texts) - expected).abs().max() <= ATOL


# ----------------------------------------------------------------------------- protocols


def _runner_model(llm: LLM):
    return llm.engine.model_runner.model


def test_native_models_declare_their_contracts(tiny_llm, tiny_decoder_llm):
    encoder = _runner_model(tiny_llm("bert"))
    assert isinstance(encoder, EncoderModel) and isinstance(encoder, LoadableModel)
    assert not isinstance(encoder, DecoderModel) and not isinstance(encoder, ClassifierHead)
    assert encoder.is_causal is False and encoder.supports_first_token_only is True
    for kind in ("bert-cross-encoder", "roberta-classifier"):
        classifier = _runner_model(tiny_llm(kind))
        assert isinstance(classifier, EncoderModel) and isinstance(classifier, ClassifierHead)
        assert classifier.default_pooling_type == "CLS"
    decoder = _runner_model(tiny_decoder_llm("llama"))
    assert isinstance(decoder, DecoderModel) and isinstance(decoder, LanguageModelHead)
    assert isinstance(decoder, LoadableModel) and not isinstance(decoder, EncoderModel)
    assert decoder.is_causal is True and decoder.default_pooling_type == "LAST"


def test_native_bodies_and_gemma_declare_their_contracts():
    from transformers import Gemma2Config, LlamaConfig

    from tidepool.models.gemma import Gemma2ForCausalLM
    from tidepool.models.llama import LlamaModel

    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        body = LlamaModel(LlamaConfig(**sizes))
        gemma = Gemma2ForCausalLM(Gemma2Config(head_dim=8, query_pre_attn_scalar=8, **sizes))
    assert isinstance(body, DecoderModel) and not isinstance(body, LanguageModelHead)
    assert isinstance(gemma, DecoderModel) and isinstance(gemma, LanguageModelHead)
    assert gemma.attention_spec(CPU, F32).head_dim == 8
    gemma.set_attention_backend(PAGED_SDPA)
    assert all(layer.self_attn.attn.backend is PAGED_SDPA for layer in gemma.model.layers)


def test_transformers_backend_models_declare_their_contracts(tiny_model_path, tiny_decoder_path):
    from tidepool.transformers_backend.wrappers import (
        TransformersDecoderModel,
        TransformersEncoderModel,
    )

    kwargs = dict(device="cpu", dtype="float32", model_impl="transformers")
    encoder = _runner_model(LLM(str(tiny_model_path("bert")), **kwargs))
    assert isinstance(encoder, TransformersEncoderModel) and isinstance(encoder, EncoderModel)
    assert not isinstance(encoder, DecoderModel) and encoder.supports_first_token_only is False
    decoder = _runner_model(LLM(str(tiny_decoder_path("llama")), **kwargs))
    assert isinstance(decoder, TransformersDecoderModel) and isinstance(decoder, DecoderModel)
    assert isinstance(decoder, LanguageModelHead) and decoder.attention_backend is PAGED_SDPA
