"""The sweep's encoder entries (grid.py describes the data): BERT / RoBERTa / XLM-R and their
heads, MPNet, T5, DeBERTa-v2 / v3."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sweep.grid import (
    DEBERTA,
    DEBERTA_V2,
    DEBERTA_V3,
    ROBERTA_IDS,
    T5,
    Case,
    Model,
    _bert,
    _encoder_cases,
    _st,
    bert_sizes,
)


def bert_family() -> list[Case]:
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


def roberta_family() -> list[Case]:
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


def mpnet_family() -> list[Case]:
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


def t5_family() -> list[Case]:
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


def deberta_family() -> list[Case]:
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
        cases.append(Case(model(f"deberta-{key}", **options), "tokens", ci=ci))
    ce_v3 = model(
        "deberta-ce/v3-b16-r-1",
        "DebertaV2ForSequenceClassification",
        num_labels=1,
        **{**DEBERTA_V3, "max_relative_positions": -1},
    )
    cases.append(Case(ce_v3, "cross_encoder"))
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
