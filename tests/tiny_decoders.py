"""Tiny random causal decoders (Llama, Mistral, Qwen2, Qwen3) with a tiny trained BPE tokenizer.

hidden 64, 2 layers, 4 query heads / 2 KV heads (GQA), vocabulary ~400. Built once per session
with fixed seeds and saved with `save_pretrained`; nothing is downloaded. initializer_range 0.2
makes the logits peaked, so greedy decoding rarely meets near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch
from st_metadata import write_st_metadata

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital and most populous city of France.",
    "Instruct: retrieve passages that answer the question. Query: what is a KV cache?",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Chunked prefill splits a long prompt over several engine steps.",
    "Prefix caching computes a shared instruction once and reuses its blocks.",
    "Hello world! Streaming detokenization turns tokens back into text, one at a time.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) are tokens too.",
]

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
)

# kind → (transformers config class name, model class name, extra config, seed)
KINDS: dict[str, tuple[str, str, dict, int]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, 10),
    "llama-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        11,
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        12,
    ),
    # A window of 24 tokens: generation past it checks windowed masks and dropped blocks.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}, 13),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}, 14),
    # Layer 0 full attention, layer 1 a sliding window of 16: two KV-cache groups in one pool.
    "qwen2-hybrid": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        21,
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, 15),
    # Bare bodies (embedding models): saved by *Model, no LM head in the checkpoint.
    "llama-embed": ("LlamaConfig", "LlamaModel", {}, 16),
    "qwen3-embed": ("Qwen3Config", "Qwen3Model", {"head_dim": 16}, 17),
}


def save_tokenizer(folder: Path) -> int:
    """A byte-level BPE trained on CORPUS, with BOS added and a chat template; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", BOS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(folder))
    return len(fast)


def build_tiny_decoder(kind: str, folder: Path) -> Path:
    import transformers

    config_name, model_name, extra, seed = KINDS[kind]
    folder.mkdir(parents=True)
    vocab_size = save_tokenizer(folder)
    config = getattr(transformers, config_name)(vocab_size=vocab_size, **SIZES, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(str(folder))
    return folder


def write_st_pooling(folder: Path, mode: str) -> None:
    """sentence-transformers metadata (new-style key): Transformer → Pooling(mode)."""
    pooling = {"word_embedding_dimension": SIZES["hidden_size"], "pooling_mode": mode}
    write_st_metadata(folder, pooling)


# ----------------------------------------------------------------------------- fixtures
# Imported by tests/conftest.py so that every test directory shares one session instance.

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_decoder_path(tmp_path_factory):
    """kind → folder of a tiny random decoder (built on first use); kinds: KINDS."""
    root = tmp_path_factory.mktemp("tiny_decoders")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_decoder(kind, root / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_decoder_llm(tiny_decoder_path):
    """kind → a tidepool LLM on that tiny decoder, float32 on CPU (one per kind)."""
    from tidepool import LLM

    engines: dict = {}

    def get(kind: str):
        if kind not in engines:
            engines[kind] = LLM(str(tiny_decoder_path(kind)), device="cpu", dtype="float32")
        return engines[kind]

    return get


@pytest.fixture(scope="session")
def hf_decoder(tiny_decoder_path):
    """kind → (transformers model in float32 eval mode, its tokenizer), loaded once."""
    import transformers

    loaded: dict = {}

    def get(kind: str):
        if kind not in loaded:
            path = str(tiny_decoder_path(kind))
            auto = "AutoModelForCausalLM" if KINDS[kind][1].endswith("ForCausalLM") else "AutoModel"
            model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32).eval()
            loaded[kind] = (model, transformers.AutoTokenizer.from_pretrained(path))
        return loaded[kind]

    return get
