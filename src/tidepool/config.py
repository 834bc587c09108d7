"""Engine configuration: frozen dataclasses, built once from the entry point's arguments
(model_loader/resolve.py's `build_model_config` for the model) and read-only afterwards.

A leaf: of tidepool it imports only devices.py (which imports none), so every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidepool.devices import device_memory_bytes


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module: y = activation(x @ W.T + b)."""

    weight: torch.Tensor
    """[out_features, in_features], float32."""
    bias: torch.Tensor | None
    """[out_features], or None without a bias."""
    activation: str
    """ "identity" or "tanh" (torch.nn.modules.activation.Tanh), ..."""


@dataclass(frozen=True)
class SentenceTransformersMeta:
    """What the sentence-transformers files of a model folder say; all optional."""

    pooling_mode: str | None = None
    """"CLS", "MEAN", "LAST", "MAX"... from 1_Pooling/config.json."""
    include_prompt: bool = True
    """Pooling covers the prompt's tokens too (1_Pooling/config.json's include_prompt)."""
    dense: tuple[DenseModule, ...] = ()
    """The Dense modules after pooling, in order."""
    normalize: bool = False
    """A Normalize module follows: embeddings are L2-normalized."""
    max_seq_length: int | None = None
    """sentence_bert_config.json's max_seq_length: caps max_model_len."""
    do_lower_case: bool = False
    """The tokenizer module lower-cases texts first."""
    prompts: dict[str, str] = field(default_factory=dict)
    """Prompt name → text prepended to inputs (config_sentence_transformers.json)."""
    default_prompt_name: str | None = None
    """The prompt used when a request names none."""
    is_sentence_transformer: bool = False
    """The folder has a modules.json (a sentence-transformers pipeline)."""
    tokenizer_max_length: int | None = None
    """tokenizer_config.json's model_max_length (None when unset or the "no limit" value):
    sentence-transformers truncates a plain folder's texts there (its Transformer module takes
    min(max_position_embeddings, model_max_length)), so it caps a plain encoder's default
    max_model_len."""


@dataclass(frozen=True)
class SparseHeadConfig:
    """How a sparse head turns token scores into (token id, weight) pairs."""

    pooling_strategy: str = "max"
    """SPLADE: "max" or "sum" over the text's tokens (SpladePooling's pooling_strategy)."""
    activation_function: str = "relu"
    """SPLADE: "relu" (log(1 + relu(x))) or "log1p_relu" (log(1 + log(1 + relu(x))))."""
    skip_token_ids: tuple[int, ...] = ()
    """BGE-M3: token ids that never get a weight (CLS, EOS, PAD, UNK, as FlagEmbedding)."""


@dataclass(frozen=True)
class MultiVectorMeta:
    """A ColBERT (late-interaction) model: one vector per token, queries and documents encoded
    by different rules (the colbert-ir and PyLate layouts; model_loader/colbert.py reads them)."""

    query_prefix: str | None
    """Marker token inserted after the first special token of a query ("[unused0]", "[Q] ");
    None: no marker."""
    document_prefix: str | None
    """Marker token inserted after the first special token of a document; None: no marker."""
    query_length: int = 32
    """A query's length in tokens, marker and special tokens included: longer ones are cut,
    shorter ones padded with [MASK] when `do_query_expansion` (colbert-ir's query_maxlen)."""
    document_length: int = 180
    """Most tokens of a document, marker and special tokens included (doc_maxlen)."""
    do_query_expansion: bool = True
    """Pad queries with [MASK] to `query_length` (query augmentation)."""
    attend_to_expansion_tokens: bool = False
    """The [MASK] tokens are attended to by the others; False: they attend to the query's text
    only (its number of attended tokens, Request.num_attended_tokens)."""
    skiplist_words: tuple[str, ...] = ()
    """Tokens whose vectors are dropped from documents (punctuation: mask_punctuation)."""


CHUNK_SCORE_AGGREGATIONS = ("max", "mean", "first")


@dataclass(frozen=True)
class PoolerConfig:
    """How pooled outputs are made beyond the model's own files (vLLM's --pooler-config, with
    vLLM 0.32's field names)."""

    task: str | None = None
    """The pooling task a call that names none runs (vLLM's `task`): one the model serves, e.g.
    "token_embed" makes an embedding model answer per token and score by MaxSim; None: the
    model's own first task."""
    pooling_type: str | None = None
    """Shorthand (vLLM's): a sequence pooling ("CLS", "MEAN", "LAST", "MAX") sets
    `seq_pooling_type`, "ALL" sets `tok_pooling_type`."""
    seq_pooling_type: str | None = None
    """Replaces the pooling of the model's files (1_Pooling/config.json): "CLS", "MEAN", "LAST"
    (vLLM's) or "MAX"; None: the model's own."""
    tok_pooling_type: str | None = None
    """Per-token pooling: "ALL" (every token's vector, what token_embed gives); vLLM's "STEP"
    (reward models) is refused."""
    enable_chunked_processing: bool = False
    """A text longer than max_model_len is split into chunks that each fit (special tokens
    added to each), run as separate sequences, and their outputs combined (engine/chunked.py);
    off: such a text is refused, as before."""
    max_embed_len: int | None = None
    """With chunked processing: the longest input accepted, in tokens of text (longer: 400 up
    front); None: engine/chunked.py's DEFAULT_MAX_EMBED_LEN (131,072), which bounds memory."""
    chunk_score_aggregation: str = "max"
    """Cross-encoders with chunked processing: a long document's score from its chunks' scores
    (each chunk paired with the query): "max", "mean" or "first"."""
    # vLLM fields tidepool does not implement: refused unless left at None.
    use_activation: bool | None = None
    dimensions: int | None = None
    logit_mean: float | None = None
    logit_sigma: float | None = None
    logit_bias: float | None = None
    logit_scale: float | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    normalize: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None

    def __post_init__(self) -> None:
        if self.max_embed_len is not None and (
            isinstance(self.max_embed_len, bool)
            or not isinstance(self.max_embed_len, int)
            or self.max_embed_len < 1
        ):
            raise ValueError(f"max_embed_len must be an integer >= 1, got {self.max_embed_len!r}")
        if self.chunk_score_aggregation not in CHUNK_SCORE_AGGREGATIONS:
            raise ValueError(
                f"chunk_score_aggregation must be one of {', '.join(CHUNK_SCORE_AGGREGATIONS)}, "
                f"got {self.chunk_score_aggregation!r}"
            )
        for name in POOLER_CONFIG_REFUSED:
            if getattr(self, name) is not None:
                raise ValueError(
                    f"pooler_config {name} is not supported here: {POOLER_CONFIG_REFUSED[name]}"
                )
        self._resolve_pooling_type()

    def _resolve_pooling_type(self) -> None:
        """`pooling_type` into seq_ / tok_pooling_type (vLLM's rule), then the checks."""
        kind = self.pooling_type
        if kind is not None:
            for other in ("seq_pooling_type", "tok_pooling_type"):
                given = getattr(self, other)
                if given is not None and str(given).upper() != str(kind).upper():
                    raise ValueError(f"give pooling_type or {other}, not both")
            name = (
                "tok_pooling_type" if str(kind).upper() in TOK_POOLING_TYPES else "seq_pooling_type"
            )
            object.__setattr__(self, name, kind)
        seq, tok = self.seq_pooling_type, self.tok_pooling_type
        if seq is not None:
            object.__setattr__(self, "seq_pooling_type", str(seq).upper())
            if self.seq_pooling_type not in SEQ_POOLING_TYPES:
                raise ValueError(
                    f"seq_pooling_type must be one of {', '.join(SEQ_POOLING_TYPES)}, got {seq!r}"
                )
        if tok is not None:
            object.__setattr__(self, "tok_pooling_type", str(tok).upper())
            if self.tok_pooling_type != "ALL":
                raise ValueError(
                    f"tok_pooling_type {tok!r} is not supported here: only ALL (every token's "
                    "vector; vLLM's STEP pooling for reward models is not implemented)"
                )


SEQ_POOLING_TYPES = ("CLS", "MEAN", "LAST", "MAX")
TOK_POOLING_TYPES = ("ALL", "STEP")
POOLER_CONFIG_REFUSED = {
    "use_activation": "give use_activation per request (PoolingParams, or the HTTP field)",
    "dimensions": "give dimensions per request (PoolingParams, or the HTTP field)",
    "logit_mean": "no score calibration (Platt scaling) of classifier logits",
    "logit_sigma": "no score calibration (Platt scaling) of classifier logits",
    "logit_bias": "no score calibration (Platt scaling) of classifier logits",
    "logit_scale": "no score calibration (Platt scaling) of classifier logits",
    "step_tag_id": "no STEP pooling (reward models)",
    "returned_token_ids": "no STEP pooling (reward models)",
    "normalize": "removed in vLLM; give use_activation per request",
    "softmax": "removed in vLLM; give use_activation per request",
    "activation": "removed in vLLM; give use_activation per request",
}


@dataclass(frozen=True)
class ModelConfig:
    """The model: where it is, what it is, what it runs as (model_loader/resolve.py builds it)."""

    model: str
    """The name the user gave (a folder or a model id)."""
    path: Path
    """The folder the model was found in."""
    hf_config: Any
    """transformers' PretrainedConfig of the model."""
    architecture: str
    """The architecture we build (after `convert`)."""
    task: str
    """"embed", "classify" (pooling runner) or "generate" (sampling runner)."""
    dtype: torch.dtype
    """The dtype weights and activations run in."""
    device: torch.device
    """The torch device the model runs on."""
    max_model_len: int
    """Longest prompt in tokens (special tokens included)."""
    st: SentenceTransformersMeta
    """sentence-transformers metadata (pooling mode, Dense, Normalize, prompts)."""
    seed: int = 0
    """torch's random seed; the model runner applies it when it starts."""
    is_causal: bool = False
    """Causal (decoder) attention: the model keeps a paged KV cache, chunked prefill and prefix
    caching apply. False for bidirectional encoders, which run each prompt whole in one step."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids from generation_config.json (else config.json); generation stops there."""
    model_impl: str = "native"
    """ "native" (tidepool's model code), "transformers" (Hugging Face's modeling code with
    tidepool's attention: transformers_backend/backend.py) or "fallback" (the HF model as it is,
    on padded batches: transformers_backend/fallback.py)."""
    trust_remote_code: bool = False
    """The transformers backend may run modeling code shipped in the model folder."""
    output_head: str = "task"
    """The head outputs come from, by its name in the output-head registry (output_heads/):
    "task" (the task's own: embeddings, sequence logits, LM logits), "splade" (an MLM head,
    SPLADE-pooled), "bge_m3" (dense + sparse + multi-vector), "token_classifier" (per-token
    labels) or a registered plugin's."""
    head_tasks: tuple[str, ...] = ()
    """The pooling tasks of `output_head` (its OutputHead's `tasks`, filled by the resolver);
    () for "task", whose tasks follow from `task`."""
    sparse: SparseHeadConfig | None = None
    """Sparse pooling settings of the "splade" and "bge_m3" heads."""
    score_template: str | None = None
    """Decoder rerankers: the prompt each (query, document) pair is rendered into, with `{query}`
    and `{document}` (engine/score_template.py); None: the tokenizer's pair encoding."""
    multi_vector: MultiVectorMeta | None = None
    """A ColBERT model (late interaction): it serves token_embed (by default) and scores by
    MaxSim; None for every other model."""
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    """Pooler options given by the user (chunked processing of long inputs)."""
    quantization: str | None = None
    """ "int8": the encoder's linear layers run int8 GEMMs (quantization/int8.py); None: the
    model runs in `dtype` throughout."""
    revision: str | None = None
    """The Hub revision asked for (branch, tag or commit); None: the default branch."""
    source: str = "local folder"
    """Where the folder came from: "local folder", "Hugging Face cache", "Hub" or "package
    <name>" (checkpoint/loader.py)."""
    commit: str | None = None
    """The Hub commit of the snapshot (from the cache or the Hub); None for a local folder or a
    package."""
    tokenizer: str | None = None
    """Where the tokenizer loads from (a folder or a cached model id); None: the model's folder."""
    chat_template: str | None = None
    """The chat template (Jinja) that replaces the tokenizer's; None: the tokenizer's own."""

    @property
    def tokenizer_source(self) -> str:
        """What `AutoTokenizer.from_pretrained` loads: `tokenizer`, else the model's folder."""
        return self.tokenizer or str(self.path)

    def __post_init__(self) -> None:
        if isinstance(self.max_model_len, bool) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if (self.output_head == "task") != (not self.head_tasks):
            raise ValueError(
                f"output_head {self.output_head!r} with head_tasks {self.head_tasks}: the "
                '"task" head has none, every other head its own'
            )

    @property
    def runner_type(self) -> str:
        """ "generate" (hidden states → logits → sampler) or "pooling" (→ pooler)."""
        return "generate" if self.task == "generate" else "pooling"

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks this model serves (the one rule the pooler and the entry points
        read): a classifier classifies, and with one label also scores (a cross-encoder's
        relevance, sigmoid); any other pooling model embeds; a generating model pools nothing.
        A model with its own output head serves that head's tasks (`head_tasks`): a SPLADE
        model sparse embeddings, BGE-M3 dense, sparse and multi-vector, a token classifier
        per-token labels."""
        if self.task == "generate":
            return ()
        if self.head_tasks:
            return self.head_tasks
        if self.task == "classify":
            return ("classify", "score") if self.num_labels == 1 else ("classify",)
        if self.multi_vector is not None:
            return ("token_embed",)
        return ("embed", "token_embed")

    @property
    def num_labels(self) -> int:
        return int(getattr(self.hf_config, "num_labels", 1))

    @property
    def default_pooling_task(self) -> str:
        """The pooling task of a call that names none: the model's first (embed for an
        embedder, classify for a classifier, token_classify for a token classifier)."""
        tasks = self.pooling_tasks
        if self.pooler.task is not None:
            return self.pooler.task
        return tasks[0] if tasks else "embed"

    @property
    def uses_token_type_ids(self) -> bool:
        return int(getattr(self.hf_config, "type_vocab_size", 0) or 0) > 1


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may hold."""

    max_num_batched_tokens: int = 16384
    """Token budget of one engine step (sum of scheduled tokens)."""
    max_num_seqs: int = 256
    """Most sequences in one engine step."""
    enable_chunked_prefill: bool = True
    """Causal models: a prompt longer than the step's remaining budget runs over several steps
    (mixed with decoding requests). Encoders always run a prompt whole."""
    long_prefill_token_threshold: int = 0
    """Causal models with chunked prefill: most prompt tokens one request runs in one step (vLLM's
    setting of that name); 0: no cap beyond the step's budget. A hybrid KV cache frees the blocks
    that leave a sliding window after each chunk, so smaller chunks keep fewer blocks in flight."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


# KV-cache budget on CPU when none is given: vLLM's VLLM_CPU_KVCACHE_SPACE default, at most a
# quarter of the memory available now. The engine caps it further at what max_num_seqs requests
# of max_model_len tokens can use, so small models take little of it.
CPU_DEFAULT_KV_CACHE_BYTES = 4 << 30
CPU_DEFAULT_KV_CACHE_SHARE = 0.25
# On a GPU, the share of its memory the whole process may use (vLLM's gpu_memory_utilization).
GPU_DEFAULT_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache of causal models (encoders keep none)."""

    block_size: int = 16
    """Tokens per KV block (and per prefix-cache hash)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token prefix was computed before (chained hashes)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache. None: `memory_fraction` where given, else on CPU 4 GiB (at most a
    quarter of the available memory) and on a GPU a 0.9 memory fraction."""
    memory_fraction: float | None = None
    """Share of the device's total memory the whole process may use; the KV cache gets what the
    loaded model leaves of it (vLLM's gpu_memory_utilization)."""
    disable_hybrid_kv_cache_manager: bool = False
    """Sliding-window layers keep every block like full attention (one group where head shapes
    agree): the uniform layout, the baseline the hybrid one is measured against (vLLM's name)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.memory_fraction is not None:
            raise ValueError("give kv_cache_memory_bytes or memory_fraction, not both")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")

    def budget(self, device: torch.device) -> tuple[int | None, float | None]:
        """(kv_cache_memory_bytes, memory_fraction) for `plan_kv_cache`: exactly one is set."""
        if self.kv_cache_memory_bytes is not None or self.memory_fraction is not None:
            return self.kv_cache_memory_bytes, self.memory_fraction
        if device.type == "cpu":
            available, _ = device_memory_bytes(device)
            return min(
                CPU_DEFAULT_KV_CACHE_BYTES, int(available * CPU_DEFAULT_KV_CACHE_SHARE)
            ), None
        return None, GPU_DEFAULT_MEMORY_FRACTION


DEFAULT_MAX_IMAGE_BYTES = 32 * 2**20
"""The largest encoded image read (a file, a download, a data: URL's bytes): 32 MiB, the
server's default request body limit."""
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""The most pixels an image may have (width x height), checked from its header before its
pixels are decoded: Pillow's own MAX_IMAGE_PIXELS (1024**3 // 4 // 3, a 256 MiB RGBA image)."""
DEFAULT_IMAGE_FETCH_TIMEOUT_S = 5.0
"""vLLM's VLLM_IMAGE_FETCH_TIMEOUT default: an http(s) image that takes longer fails."""


@dataclass(frozen=True)
class MediaConfig:
    """Where user images may come from and how large they may be (multimodal/media.py reads it;
    EngineArgs' allowed_local_media_path, allowed_media_domains, allow_remote_media,
    max_image_bytes, max_image_pixels and env VLLM_IMAGE_FETCH_TIMEOUT build it)."""

    allowed_local_media_path: Path | None = None
    """Local files (a path or a file:// URL) are read only inside this folder (resolved, so a
    symlink out of it is outside); None: no local files."""
    allowed_media_domains: tuple[str, ...] | None = None
    """http(s) images only from these host names (every redirect hop too); None: see
    allow_remote_media."""
    allow_remote_media: bool = False
    """http(s) images from any host that is not private, loopback or link-local; with neither
    this nor allowed_media_domains, http(s) images are refused."""
    fetch_timeout_s: float = DEFAULT_IMAGE_FETCH_TIMEOUT_S
    """The whole download of one image (connect, headers and body) must end within it."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    """What runs: the resolved model, its task, dtype, device and length limit."""
    scheduler: SchedulerConfig
    """How steps are filled: token budget, sequence limit, chunked prefill."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The paged KV cache of causal models (unused by encoders)."""
    num_threads: int | None = None
    """torch intra-op threads, applied when the engine starts; None: the cores this process may
    run on."""
    media: MediaConfig = field(default_factory=MediaConfig)
    """Where user images may come from and their limits (the entry points read it)."""
