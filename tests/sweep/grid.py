"""The sweep's grid, as data: tiny checkpoints (Model) and what runs on each (Case).

A new architecture joins the sweep with one `Model` entry (its transformers config class, model
class, sizes and options, tokenizer kind, layout) and the `Case`s to run on it (path, output,
dtype), in grid_encoders.py, grid_decoders.py or grid_images.py; `python -m sweep.grid` from tests/ prints the
grid's size. `ci=True` puts a case in the
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
    image_embed     embed (raw) of images and texts vs transformers' get_image_features /
                    get_text_features (CLIP, SigLIP, SigLIP 2), image_embeds / pooler_output
                    (the vision towers alone)
    multivector     token_embed of pages and queries vs ColPali / ColQwen2ForRetrieval
                    .embeddings at the unpadded tokens
    vlm_last        embed (raw) of Qwen2-VL prompts (texts, images inside texts) vs the last
    vlm_mean        hidden state of transformers' Qwen2-VL body at the last token / its mean
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
    (tiny_decoders' BPE), t5, reranker (a Qwen-like BPE with "yes" / "no"), image (the image
    folder builders' own tokenizer)."""
    layout: str = "hf"
    """hf (save_pretrained only), st (a sentence-transformers pipeline), splade, bge_m3,
    colbert_ir; the image folders of images.LAYOUTS (the per-model tests' builders)."""
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
        parts += [
            k if isinstance(v, dict) else f"{k}={v}" for k, v in sorted(self.llm_kwargs.items())
        ]
        return "/".join(parts)

    @property
    def engine_key(self) -> tuple:
        """Cases with the same key share one tidepool LLM (the backend is switched on it)."""
        return (
            self.model.key,
            self.path,
            self.dtype,
            self.quantization,
            repr(sorted(self.llm_kwargs.items())),
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


def _encoder_cases(model: Model, output: str = "tokens", ci: bool = False, **kw: Any) -> list[Case]:
    """A native encoder on SDPA, and on the CPU kernel where its heads fit the kernel."""
    heads = model.config.get("num_attention_heads", model.config.get("num_heads"))
    width = model.config.get("d_kv") or model.config.get("head_dim")
    width = width or model.config.get("hidden_size", 0) // heads
    cases = [Case(model, output, "native", backend="sdpa", ci=ci, **kw)]
    if width in KERNEL_HEAD_DIMS:
        cases.append(Case(model, output, "native", backend="kernel", ci=ci, **kw))
    return cases


# ----------------------------------------------------------------------------- the grid
# The entries: grid_encoders.py, grid_decoders.py.


def all_cases() -> list[Case]:
    from sweep import grid_decoders, grid_encoders, grid_images

    cases = [
        *grid_encoders.bert_family(),
        *grid_encoders.roberta_family(),
        *grid_encoders.mpnet_family(),
        *grid_encoders.t5_family(),
        *grid_encoders.deberta_family(),
        *grid_decoders.decoder_family(),
        *grid_decoders.backend_family(),
        *grid_decoders.reduced_precision(),
        *grid_images.image_family(),
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
