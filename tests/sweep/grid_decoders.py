"""The sweep's decoder entries, the architectures without a native model (transformers backend,
fallback) and the reduced-precision paths (grid.py describes the data)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sweep.grid import (
    DEBERTA,
    DEBERTA_V2,
    DECODER,
    GEMMA,
    ROBERTA_IDS,
    T5,
    Case,
    Model,
    _bert,
    _encoder_cases,
    bert_sizes,
)


def _decoder(key: str, family: str, hf_class: str | None = None, **options: Any) -> Model:
    return Model(
        key, f"{family}Config", hf_class or f"{family}Model", {**DECODER, **options}, "decoder"
    )


CHUNKED = {"max_num_batched_tokens": 48}
"""Decoder prompts longer than this run over several steps (chunked prefill)."""


def decoder_family() -> list[Case]:
    cases: list[Case] = []
    llama = _decoder("llama", "Llama")
    cases.append(Case(llama, "tokens", ci=True))
    cases.append(Case(llama, "tokens", llm_kwargs=CHUNKED, ci=True))
    for key, options in (
        ("llama/rope-linear", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        (
            "llama/rope-llama3",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
        ("llama/theta=500", {"rope_theta": 500.0}),
        ("llama/bias", {"attention_bias": True, "mlp_bias": True}),
        ("llama/head_dim=32", {"head_dim": 32}),
        ("llama/mha", {"num_key_value_heads": 4}),
    ):
        cases.append(Case(_decoder(key, "Llama", **options), "tokens"))
    for key, options, match in (
        (
            "llama/rope-dynamic",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "dynamic",
        ),
        ("llama/rope-yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        (
            "llama/rope-longrope",
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 64,
                }
            },
            "longrope",
        ),
        ("llama/act=gelu", {"hidden_act": "gelu"}, "hidden_act"),
        # transformers' Llama rotates the whole head whatever the factor; vLLM the fraction.
        ("llama/partial-rotary", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ):
        cases.append(Case(_decoder(key, "Llama", **options), "refuse", refuses=match))
    lm = _decoder("llama-lm", "Llama", "LlamaForCausalLM")
    cases.append(Case(lm, "tokens", llm_kwargs={"runner": "pooling"}))
    cases.append(
        Case(_decoder("mistral/window16", "Mistral", sliding_window=16), "tokens", ci=True)
    )
    cases.append(Case(_decoder("qwen2", "Qwen2"), "tokens"))
    hybrid = _decoder(
        "qwen2/hybrid", "Qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    cases.append(Case(hybrid, "tokens", ci=True))
    cases.append(Case(hybrid, "tokens", llm_kwargs=CHUNKED))
    cases.append(Case(_decoder("qwen3", "Qwen3", head_dim=16), "tokens", ci=True))
    cases.append(Case(_decoder("qwen3/head_dim=32", "Qwen3", head_dim=32), "tokens"))
    qwen3_hybrid = _decoder(
        "qwen3/hybrid",
        "Qwen3",
        head_dim=16,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    )
    cases.append(Case(qwen3_hybrid, "tokens"))
    cases.append(Case(_decoder("mistral/no-window", "Mistral", sliding_window=None), "tokens"))
    gemma2 = Model(
        "gemma2",
        "Gemma2Config",
        "Gemma2Model",
        {**GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
        "decoder",
    )
    cases.append(Case(gemma2, "tokens", ci=True))
    gemma3 = Model(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3TextModel",
        {**GEMMA, "sliding_window_pattern": 2, "rope_local_base_freq": 100.0},
        "decoder",
    )
    cases.append(Case(gemma3, "tokens"))
    cases.append(Case(gemma3, "tokens", llm_kwargs=CHUNKED))
    # Gemma 3 4B's shape: the full layers' RoPE scaled (linear, factor 8), the local base not.
    gemma3_scaled = replace(
        gemma3,
        key="gemma3/rope-linear",
        config={**gemma3.config, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    )
    cases.append(Case(gemma3_scaled, "tokens"))
    # Classifiers on the last token.
    llama_cls = _decoder("llama-cls3", "Llama", "LlamaForSequenceClassification", num_labels=3)
    cases.append(Case(llama_cls, "classify", ci=True))
    qwen2_cls = _decoder("qwen2-cls1", "Qwen2", "Qwen2ForSequenceClassification", num_labels=1)
    cases.append(Case(qwen2_cls, "classify"))
    reranker = Model(
        "qwen3-reranker",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {**DECODER, "head_dim": 16, "bos_token_id": None, "eos_token_id": 2},
        "reranker",
    )
    cases.append(
        Case(
            reranker,
            "rerank_vllm",
            llm_kwargs={"hf_overrides": QWEN3_RERANKER_OVERRIDES},
            ci=True,
        )
    )
    # EmbeddingGemma: bidirectional Gemma 3, mean → Dense → Dense → Normalize.
    embedding_gemma = Model(
        "embeddinggemma",
        "Gemma3TextConfig",
        "Gemma3TextModel",
        {
            **GEMMA,
            "hidden_size": 96,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 100.0,
            "use_bidirectional_attention": True,
        },
        "decoder",
        layout="st",
        st={
            "pooling": "mean",
            "dense": ((192, False, "identity"), (96, False, "identity")),
            "normalize": True,
        },
    )
    cases += _encoder_cases(embedding_gemma, "st", ci=True)
    return cases


QWEN3_RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def backend_family() -> list[Case]:
    """Architectures without a native model (the transformers backend, else the fallback), and
    native ones forced onto the backend / the fallback."""
    cases: list[Case] = []
    for model in (
        _bert("bert/h32-d16", **bert_sizes()),
        Model(
            "roberta",
            "RobertaConfig",
            "RobertaModel",
            {**bert_sizes(64, max_position_embeddings=66), **ROBERTA_IDS},
            "bpe",
        ),
    ):
        cases.append(Case(model, "tokens", "transformers", ci=model.key.startswith("bert")))
        cases.append(Case(model, "tokens", "fallback"))
    for model in (
        _decoder("llama", "Llama"),
        _decoder("mistral/window16", "Mistral", sliding_window=16),
    ):
        cases.append(Case(model, "tokens", "transformers", ci=model.key == "llama"))
    distil = Model(
        "distilbert",
        "DistilBertConfig",
        "DistilBertModel",
        dict(
            dim=32,
            n_heads=4,
            hidden_dim=64,
            n_layers=2,
            max_position_embeddings=64,
            initializer_range=0.2,
        ),
        "bert",
    )
    cases.append(Case(distil, "tokens", ci=True))
    modernbert = Model(
        "modernbert",
        "ModernBertConfig",
        "ModernBertModel",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_hidden_layers=3,
            max_position_embeddings=128,
            initializer_range=0.2,
            local_attention=8,
            global_attn_every_n_layers=3,
            pad_token_id=0,
            bos_token_id=101,
            eos_token_id=102,
            cls_token_id=101,
            sep_token_id=102,
        ),
        "bert",
    )
    cases.append(Case(modernbert, "tokens"))
    electra = Model(
        "electra-cls2",
        "ElectraConfig",
        "ElectraForSequenceClassification",
        {**bert_sizes(), "embedding_size": 16, "num_labels": 2},
        "bert",
    )
    cases.append(Case(electra, "classify"))
    roformer = Model(
        "roformer",
        "RoFormerConfig",
        "RoFormerModel",
        {**bert_sizes(), "embedding_size": 32},
        "bert",
    )
    cases.append(Case(roformer, "tokens", ci=True))
    clip = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=40,
        projection_dim=32,
        bos_token_id=101,
        eos_token_id=102,
        pad_token_id=0,
        initializer_range=0.2,
    )
    clip_tokens = Model("clip-text", "CLIPTextConfig", "CLIPTextModel", clip, "bert")
    cases.append(Case(clip_tokens, "tokens", ci=True))
    clip_proj = Model(
        "clip-text-proj", "CLIPTextConfig", "CLIPTextModelWithProjection", clip, "bert"
    )
    cases.append(Case(clip_proj, "clip_embed", ci=True))
    return cases


def reduced_precision() -> list[Case]:
    """bfloat16 and int8, with their own bounds (references.py)."""
    wide = _bert("bert/h64-d32", **bert_sizes(64))
    sizes = {**bert_sizes(64, max_position_embeddings=66), "pad_token_id": 1}
    mpnet = Model("mpnet", "MPNetConfig", "MPNetModel", sizes, "bpe")
    t5 = Model(
        "t5/relu-b8-d16", "T5Config", "T5EncoderModel", {**T5, "feed_forward_proj": "relu"}, "t5"
    )
    ce = _bert("bert-ce", "BertForSequenceClassification", num_labels=1, **bert_sizes(64))
    cases = [
        Case(wide, "tokens", dtype="bfloat16", ci=True),
        Case(wide, "tokens", "native", dtype="bfloat16", backend="kernel"),
        Case(wide, "tokens", quantization="int8", ci=True),
        Case(ce, "cross_encoder", quantization="int8"),
        Case(mpnet, "tokens", quantization="int8"),
        Case(t5, "tokens", quantization="int8", llm_kwargs={"max_model_len": 96}),
        Case(t5, "tokens", dtype="bfloat16", llm_kwargs={"max_model_len": 96}),
        Case(_decoder("llama", "Llama"), "tokens", dtype="bfloat16"),
        Case(
            Model(
                "deberta-v2/r16",
                "DebertaV2Config",
                "DebertaV2Model",
                {**DEBERTA, **DEBERTA_V2},
                "bert",
            ),
            "tokens",
            quantization="int8",
        ),
    ]
    return cases
