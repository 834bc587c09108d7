"""The sweep's grid, as data: tiny checkpoints (Model) and what runs on each (Case).

A new architecture joins the sweep with one `Model` entry (its transformers config class, model
class, sizes and options, tokenizer kind, layout) and the `Case`s to run on it (path, output,
dtype); `python -m sweep.grid` from tests/ prints the grid's size. `ci=True` puts a case in the
fixed subset every test run takes; TIDEPOOL_SWEEP=full runs them all (tests/sweep/README.md).

Outputs (how tidepool's answer is compared; references.py computes each reference):

    tokens          every token's final hidden state (token_embed, raw) vs transformers' base model
    st              embed() vs sentence-transformers' SentenceTransformer on the same token ids
    classify        classify logits vs transformers' *ForSequenceClassification
    cross_encoder   score(query, doc) vs sentence-transformers' CrossEncoder.predict (text pairs)
    token_classify  per-token logits vs transformers' *ForTokenClassification
    splade          embed_sparse vs sentence-transformers' SparseEncoder
    bge_m3          dense + lexical weights vs FlagEmbedding's BGEM3FlagModel
    colbert         token_embed of a colbert-ir checkpoint vs vLLM's formula on transformers:
                    normalize(hidden @ linear.T) for every token
    clip_embed      embed (raw) vs transformers' CLIPTextModelWithProjection text_embeds
    rerank_vllm     score() of pre-formatted Qwen3-Reranker texts vs vLLM's formula on transformers:
                    sigmoid(logit["yes"] - logit["no"]) at the last token of query + document
    refuse          loading must fail with a message naming the option (`refuses`, a regex)

Paths: "auto" (what a user gets), "native", "transformers" (model_impl), "fallback". Attention
backends of native encoders: "sdpa" (every machine) and "kernel" (tidepool's CPU kernel: only where
it loads, cpu_features.requires_cpu_kernel; head widths 32 / 64 / 128 only).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

# ----------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class Model:
    key: str
    config_class: str
    hf_class: str
    config: dict[str, Any]
    tokenizer: str
    """bert (all-MiniLM's WordPiece), bpe / unigram (conftest's RoBERTa / XLM-R-like), decoder
    (tiny_decoders' BPE), t5, reranker (a Qwen-like BPE with "yes" / "no")."""
    layout: str = "hf"
    """hf (save_pretrained only), st (a sentence-transformers pipeline), splade, bge_m3,
    colbert_ir."""
    st: dict[str, Any] | None = None
    """st / splade layouts: pooling, dense [(out, bias, act)], layer_norm, normalize."""

    @property
    def seed(self) -> int:
        return zlib.crc32(self.key.encode()) % 100_000

    @property
    def depth(self) -> int:
        """Chained layers for the float32 bound: the blocks plus embedding / head."""
        layers = self.config.get("num_hidden_layers", self.config.get("num_layers", 2))
        return int(layers) + 1

    @property
    def widest(self) -> int:
        """The longest non-sequence reduction (hidden, FFN, heads' inner width)."""
        keys = ("hidden_size", "d_model", "intermediate_size", "d_ff")
        return max(int(self.config.get(k, 0)) for k in keys)


@dataclass(frozen=True)
class Case:
    model: Model
    output: str
    path: str = "auto"
    dtype: str = "float32"
    quantization: str | None = None
    backend: str | None = None
    """Native encoders: "sdpa" or "kernel"; None: what the loader chose."""
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    ci: bool = False
    xfail: str | None = None
    """A known bug being fixed elsewhere: pytest.mark.xfail(strict=True, reason=xfail)."""
    refuses: str | None = None
    """output "refuse": the regex the load error must match."""

    @property
    def id(self) -> str:
        parts = [self.model.key, self.output, self.path]
        if self.dtype != "float32":
            parts.append(self.dtype)
        if self.quantization:
            parts.append(self.quantization)
        if self.backend:
            parts.append(self.backend)
        parts += [f"{k}={v}" for k, v in sorted(self.llm_kwargs.items())]
        return "/".join(parts)

    @property
    def engine_key(self) -> tuple:
        """Cases with the same key share one tidepool LLM (the backend is switched on it)."""
        return (
            self.model.key,
            self.path,
            self.dtype,
            self.quantization,
            tuple(sorted(self.llm_kwargs.items())),
        )


# ----------------------------------------------------------------------------- sizes

KERNEL_HEAD_DIMS = (32, 64, 128)


def bert_sizes(hidden: int = 32, heads: int = 2, layers: int = 2, **extra: Any) -> dict[str, Any]:
    sizes: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    return {**sizes, **extra}


ROBERTA_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
DEBERTA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    initializer_range=0.2,
    pad_token_id=0,
    relative_attention=True,
    pos_att_type=["p2c", "c2p"],
)
DEBERTA_V3 = dict(
    share_att_key=True,
    position_buckets=16,
    max_relative_positions=64,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
    type_vocab_size=0,
)
DEBERTA_V2 = dict(
    share_att_key=False,
    position_buckets=-1,
    max_relative_positions=16,
    position_biased_input=True,
    type_vocab_size=2,
)
T5 = dict(
    d_model=64,
    d_kv=32,
    num_heads=4,
    num_layers=2,
    d_ff=128,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
)
DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GEMMA = dict(
    DECODER,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=16,
    initializer_range=0.05,
)


def _bert(key: str, hf_class: str = "BertModel", **config: Any) -> Model:
    return Model(key, "BertConfig", hf_class, {"type_vocab_size": 2, **config}, "bert")


def _st(model: Model, key: str, **st: Any) -> Model:
    return replace(model, key=key, layout="st", st=st)


# ----------------------------------------------------------------------------- the grid


def _encoder_cases(model: Model, output: str = "tokens", ci: bool = False, **kw: Any) -> list[Case]:
    """A native encoder on SDPA, and on the CPU kernel where its heads fit the kernel."""
    heads = model.config.get("num_attention_heads", model.config.get("num_heads"))
    width = model.config.get("d_kv") or model.config.get("head_dim")
    width = width or model.config.get("hidden_size", 0) // heads
    cases = [Case(model, output, "native", backend="sdpa", ci=ci, **kw)]
    if width in KERNEL_HEAD_DIMS:
        cases.append(Case(model, output, "native", backend="kernel", ci=ci, **kw))
    return cases


def _bert_family() -> list[Case]:
    cases: list[Case] = []
    base = _bert("bert/h32-d16", **bert_sizes())
    wide = _bert("bert/h64-d32", **bert_sizes(64))
    cases += _encoder_cases(base, ci=True)
    cases += _encoder_cases(wide, ci=True)
    for hidden, heads, layers in ((64, 1, 2), (128, 1, 1), (48, 1, 2), (96, 3, 1)):
        key = f"bert/h{hidden}-d{hidden // heads}"
        cases += _encoder_cases(_bert(key, **bert_sizes(hidden, heads, layers)))
    for act in ("gelu_new", "relu", "silu", "gelu_pytorch_tanh", "tanh"):
        model = _bert(f"bert/act={act}", **bert_sizes(hidden_act=act))
        cases.append(Case(model, "tokens", ci=act == "gelu_new"))
    cases.append(Case(_bert("bert/types=1", **bert_sizes(type_vocab_size=1)), "tokens"))
    cases.append(Case(_bert("bert/eps=1e-5", **bert_sizes(layer_norm_eps=1e-5)), "tokens"))
    # A BertModel with is_decoder=True is causal in transformers.
    decoder = _bert("bert/is_decoder", **bert_sizes(is_decoder=True))
    cases.append(Case(decoder, "refuse", ci=True, refuses="is_decoder"))
    cases.append(Case(decoder, "tokens", "transformers"))
    # Poolers, Dense heads and Normalize, from sentence-transformers' modules.json.
    for mode, dense, norm, ci in (
        ("cls", (), False, False),
        ("mean", (), True, True),
        ("max", ((48, True, "tanh"),), False, True),
        ("lasttoken", (), False, False),
        ("mean", ((16, False, "identity"), (24, True, "tanh")), True, False),
    ):
        key = f"bert-st/{mode}" + "".join(f"+dense{o}{a[0]}" for o, _, a in dense)
        key += "+norm" * norm
        model = _st(wide, key, pooling=mode, dense=dense, normalize=norm)
        cases.append(Case(model, "st", ci=ci))
    layer_norm = _st(wide, "bert-st/mean+layernorm", pooling="mean", layer_norm=True)
    cases.append(Case(layer_norm, "refuse", ci=True, refuses="LayerNorm"))
    # Heads: cross-encoders, classifiers, token classifiers, SPLADE.
    ce = _bert("bert-ce", "BertForSequenceClassification", num_labels=1, **bert_sizes(64))
    cases.append(Case(ce, "cross_encoder", ci=True))
    cases += _encoder_cases(ce, "classify")
    cls3 = _bert("bert-cls3", "BertForSequenceClassification", num_labels=3, **bert_sizes())
    cases.append(Case(cls3, "classify"))
    ner = _bert("bert-ner", "BertForTokenClassification", num_labels=5, **bert_sizes())
    cases.append(Case(ner, "token_classify", ci=True))
    colbert = replace(_bert("colbert-ir", **bert_sizes(64)), layout="colbert_ir")
    cases.append(Case(colbert, "colbert", ci=True))
    for strategy in ("max", "sum"):
        splade = replace(
            _bert(f"splade/{strategy}", "BertForMaskedLM", **bert_sizes()),
            layout="splade",
            st={"pooling": strategy},
        )
        cases.append(Case(splade, "splade", ci=strategy == "max"))
    return cases


def _roberta_family() -> list[Case]:
    cases: list[Case] = []
    sizes = bert_sizes(64, max_position_embeddings=66)
    roberta = Model("roberta", "RobertaConfig", "RobertaModel", {**sizes, **ROBERTA_IDS}, "bpe")
    cases += _encoder_cases(roberta, ci=True)
    # pad_token_id 0: positions start at 1 (the offset follows padding_idx).
    # pad_token_id 3: positions start at 4 (the offset follows padding_idx, not the tokenizer).
    pad3 = replace(roberta, key="roberta/pad3", config={**roberta.config, "pad_token_id": 3})
    cases.append(Case(pad3, "tokens"))
    xlmr_config = {**bert_sizes(), **ROBERTA_IDS, "max_position_embeddings": 66}
    xlmr = Model("xlm-roberta", "XLMRobertaConfig", "XLMRobertaModel", xlmr_config, "unigram")
    cases.append(Case(xlmr, "tokens"))
    cls = Model(
        "roberta-cls3",
        "RobertaConfig",
        "RobertaForSequenceClassification",
        {**sizes, **ROBERTA_IDS, "num_labels": 3},
        "bpe",
    )
    cases.append(Case(cls, "classify"))
    m3 = replace(xlmr, key="bge-m3", layout="bge_m3")
    cases.append(Case(m3, "bge_m3", ci=True))
    return cases


def _mpnet_family() -> list[Case]:
    sizes = {**bert_sizes(64, max_position_embeddings=66), "pad_token_id": 1}
    mpnet = Model("mpnet", "MPNetConfig", "MPNetModel", sizes, "bpe")
    cases = _encoder_cases(mpnet, ci=True)
    table64 = replace(
        mpnet, key="mpnet/buckets=64", config={**sizes, "relative_attention_num_buckets": 64}
    )
    cases.append(Case(table64, "tokens"))
    ce = Model(
        "mpnet-ce",
        "MPNetConfig",
        "MPNetForSequenceClassification",
        {**sizes, "num_labels": 1},
        "bpe",
    )
    cases.append(Case(ce, "cross_encoder"))
    return cases


def _t5_family() -> list[Case]:
    cases: list[Case] = []
    # T5 has no position limit of its own: the cases cap prompts at 96 tokens.
    cap = {"max_model_len": 96}
    for key, config_class, hf_class, extra, ci in (
        ("t5/relu-b8-d16", "T5Config", "T5EncoderModel", {"feed_forward_proj": "relu"}, True),
        (
            "mt5/gated-gelu",
            "MT5Config",
            "MT5EncoderModel",
            {"feed_forward_proj": "gated-gelu"},
            False,
        ),
        ("t5/gated-silu", "T5Config", "T5EncoderModel", {"feed_forward_proj": "gated-silu"}, False),
        ("t5/gelu", "T5Config", "T5EncoderModel", {"feed_forward_proj": "gelu"}, False),
        (
            "t5/b32-d128",
            "T5Config",
            "T5EncoderModel",
            {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 128},
            False,
        ),
        ("t5/d_kv16", "T5Config", "T5EncoderModel", {"d_kv": 16, "num_heads": 2}, False),
    ):
        model = Model(key, config_class, hf_class, {**T5, **extra}, "t5")
        cases += _encoder_cases(model, ci=ci, llm_kwargs=cap)
    base = Model("t5", "T5Config", "T5EncoderModel", dict(T5), "t5")
    st = _st(
        base,
        "t5-st/mean+dense+norm",
        pooling="mean",
        dense=((64, False, "identity"),),
        normalize=True,
        max_seq_length=96,
    )
    cases.append(Case(st, "st"))
    return cases


DEBERTA_KNOWN = (
    "DeBERTa relative positions past the bucket range (make_log_bucket_position, the att_span "
    "clamp, max_relative_positions=-1): fixed on branch h-deberta"
)


DEBERTA_NO_RELATIVE = (
    "DeBERTa without relative attention: transformers still scales the scores by the config's "
    "pos_att_type: fixed on branch h-deberta"
)


def _deberta_family() -> list[Case]:
    cases: list[Case] = []

    def model(key: str, hf_class: str = "DebertaV2Model", **options: Any) -> Model:
        return Model(key, "DebertaV2Config", hf_class, {**DEBERTA, **options}, "bert")

    variants: list[tuple[str, dict[str, Any], bool]] = [
        ("v3/b16-r64", DEBERTA_V3, True),
        ("v3/b16-r-1", {**DEBERTA_V3, "max_relative_positions": -1}, True),
        (
            "v3/b32-r128",
            {**DEBERTA_V3, "position_buckets": 32, "max_relative_positions": 128},
            False,
        ),
        ("v3/b8-r32", {**DEBERTA_V3, "position_buckets": 8, "max_relative_positions": 32}, False),
        # Buckets wider than half the longest prompt (real v3: 256 buckets, 512 positions).
        ("v3/b64-r-1", {**DEBERTA_V3, "position_buckets": 64, "max_relative_positions": -1}, False),
        (
            "v3/b256-p512",
            {
                **DEBERTA_V3,
                "position_buckets": 256,
                "max_relative_positions": -1,
                "max_position_embeddings": 512,
            },
            True,
        ),
        ("v3/own-keys", {**DEBERTA_V3, "share_att_key": False}, False),
        ("v3/no-norm", {**DEBERTA_V3, "norm_rel_ebd": "none"}, False),
        (
            "v3/abs+types",
            {**DEBERTA_V3, "position_biased_input": True, "type_vocab_size": 2},
            False,
        ),
        ("v2/r16", DEBERTA_V2, True),
        ("v2/r-1", {**DEBERTA_V2, "max_relative_positions": -1}, False),
        ("v2/shared", {**DEBERTA_V2, "share_att_key": True}, False),
        ("no-relative", {**DEBERTA_V2, "relative_attention": False}, False),
    ]
    for pos in ([], ["c2p"], ["p2c"]):
        name = "+".join(pos) or "none"
        variants.append((f"v3/pos={name}", {**DEBERTA_V3, "pos_att_type": pos}, False))
    for key, options, ci in variants:
        xfail = DEBERTA_NO_RELATIVE if key == "no-relative" else None
        cases.append(Case(model(f"deberta-{key}", **options), "tokens", ci=ci, xfail=xfail))
    ce_v3 = model(
        "deberta-ce/v3-b16-r-1",
        "DebertaV2ForSequenceClassification",
        num_labels=1,
        **{**DEBERTA_V3, "max_relative_positions": -1},
    )
    cases.append(Case(ce_v3, "cross_encoder", ci=True))
    ce_real = model(
        "deberta-ce/v3-b256-p512",
        "DebertaV2ForSequenceClassification",
        num_labels=1,
        **{
            **DEBERTA_V3,
            "position_buckets": 256,
            "max_relative_positions": -1,
            "max_position_embeddings": 512,
        },
    )
    cases.append(Case(ce_real, "cross_encoder", ci=True))
    ce_v2 = model(
        "deberta-ce/v2-r16", "DebertaV2ForSequenceClassification", num_labels=1, **DEBERTA_V2
    )
    cases.append(Case(ce_v2, "cross_encoder"))
    ner = model("deberta-ner", "DebertaV2ForTokenClassification", num_labels=5, **DEBERTA_V3)
    cases.append(Case(ner, "token_classify"))
    return cases


def _decoder(key: str, family: str, hf_class: str | None = None, **options: Any) -> Model:
    return Model(
        key, f"{family}Config", hf_class or f"{family}Model", {**DECODER, **options}, "decoder"
    )


CHUNKED = {"max_num_batched_tokens": 48}
"""Decoder prompts longer than this run over several steps (chunked prefill)."""


def _decoder_family() -> list[Case]:
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
            xfail="Qwen3-Reranker texts pre-formatted as vLLM documents get tidepool's template a "
            "second time: fixed on branch h-rerank",
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

CLIP_KNOWN = (
    "CLIP text towers on the transformers backend: causal mask ignored, projection dropped, "
    "packed length checked against max_position_embeddings: fixed on branch h-backend"
)


def _backend_family() -> list[Case]:
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
    cases.append(Case(clip_tokens, "tokens", ci=True, xfail=CLIP_KNOWN))
    clip_proj = Model(
        "clip-text-proj", "CLIPTextConfig", "CLIPTextModelWithProjection", clip, "bert"
    )
    cases.append(Case(clip_proj, "clip_embed", ci=True, xfail=CLIP_KNOWN))
    return cases


def _reduced_precision() -> list[Case]:
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


def all_cases() -> list[Case]:
    cases = [
        *_bert_family(),
        *_roberta_family(),
        *_mpnet_family(),
        *_t5_family(),
        *_deberta_family(),
        *_decoder_family(),
        *_backend_family(),
        *_reduced_precision(),
    ]
    ids = [c.id for c in cases]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"duplicate case ids: {sorted(duplicates)}"
    models: dict[str, Model] = {}
    for case in cases:  # one key, one checkpoint
        seen = models.setdefault(case.model.key, case.model)
        assert seen == case.model, f"two different models named {case.model.key!r}"
    return cases


def full_mode() -> bool:
    """TIDEPOOL_SWEEP=full: the whole grid; otherwise the fixed CI subset."""
    return os.environ.get("TIDEPOOL_SWEEP", "").lower() == "full"


def selected_cases() -> list[Case]:
    cases = all_cases()
    return cases if full_mode() else [c for c in cases if c.ci]


if __name__ == "__main__":
    cases = all_cases()
    ci = [c for c in cases if c.ci]
    print(
        f"{len(cases)} cases on {len({c.model.key for c in cases})} checkpoints; "
        f"CI subset {len(ci)} cases on {len({c.model.key for c in ci})} checkpoints"
    )
