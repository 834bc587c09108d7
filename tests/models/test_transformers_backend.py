"""The transformers backend (HF modeling code + tidepool's attention), float32 on CPU.

1. Native vs backend on the same tiny checkpoints (BERT, RoBERTa, Llama, Qwen2, Mistral's sliding
   window): embeddings, classification and scores to 1e-5, greedy generation token for token,
   LAST pooling to 1e-5, with chunked prefill and prefix caching on for the backend.
2. Architectures with no native implementation vs transformers run directly: DistilBERT, ELECTRA
   and ModernBERT (local attention windows) encoders, Phi-3 (sliding window), OLMo and Granite
   (scaled logits) decoders.
3. Clear errors for what the backend cannot run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_SIZES, copy_bert_tokenizer
from st_metadata import write_st_metadata
from tiny_decoders import SIZES, save_tokenizer

from tidepool import LLM, PoolingParams, SamplingParams
from tidepool.attention import cpu_kernels
from tidepool.attention.backend import CPU_KERNEL
from tidepool.transformers_backend.attention import UnsupportedAttentionError

ATOL = 1e-5
TIE_TOL = 1e-4
RAW = PoolingParams(normalize=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
INSTRUCTION = "Instruct: retrieve passages that answer the question. Query: "
PROMPTS = [
    INSTRUCTION + "what is a KV cache?",
    "The quick brown fox",
    INSTRUCTION + "how do blocks work",
    "Paris is the capital and most populous city of France. Paged attention stores keys",
    "Hello",
    "Chunked prefill splits a long prompt over several engine steps. " * 3,
]
# The backend's engine settings for decoders: prompts over several steps, shared prefix reused.
CHUNKED = dict(max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True)


def _backend(path: Path | str, **kwargs) -> LLM:
    llm = LLM(str(path), device="cpu", dtype="float32", model_impl="transformers", **kwargs)
    assert llm.model_config.model_impl == "transformers"
    return llm


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    return torch.tensor(
        [o.outputs.embedding for o in llm.embed(texts, pooling_params=RAW, use_tqdm=False)]
    )


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# ----------------------------------------------------------------------------- native vs backend


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_backend_encoder_embeddings_equal_native(kind, tiny_llm, tiny_model_path, tiny_texts):
    native, backend = tiny_llm(kind), _backend(tiny_model_path(kind))
    assert native.model_config.model_impl == "native"
    assert backend.model_config.max_model_len == native.model_config.max_model_len
    assert (_embed(backend, tiny_texts) - _embed(native, tiny_texts)).abs().max() <= ATOL
    # Every token: positions (RoBERTa's start after padding_idx) and packing are right.
    ours = backend.encode(tiny_texts, RAW, pooling_task="token_embed", use_tqdm=False)
    theirs = native.encode(tiny_texts, RAW, pooling_task="token_embed", use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.outputs.data - b.outputs.data).abs().max() <= ATOL


def test_backend_cross_encoder_and_classifier_equal_native(tiny_llm, tiny_model_path, tiny_texts):
    query, docs = "what is the capital of france?", tiny_texts
    native, backend = (
        tiny_llm("bert-cross-encoder"),
        _backend(tiny_model_path("bert-cross-encoder")),
    )
    # Pairs with token type ids; the BERT pooler (dense + tanh) and classifier come from HF.
    for params in (None, PoolingParams(activation=False)):
        ours = [
            o.outputs.score
            for o in backend.score(query, docs, pooling_params=params, use_tqdm=False)
        ]
        theirs = [
            o.outputs.score
            for o in native.score(query, docs, pooling_params=params, use_tqdm=False)
        ]
        assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=ATOL)
    native, backend = (
        tiny_llm("roberta-classifier"),
        _backend(tiny_model_path("roberta-classifier")),
    )
    ours = [o.outputs.probs for o in backend.classify(tiny_texts, use_tqdm=False)]
    theirs = [o.outputs.probs for o in native.classify(tiny_texts, use_tqdm=False)]
    assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=ATOL)


def _assert_same_greedy(ours, theirs, hf, prompt_ids) -> None:
    """Token for token; a divergence is allowed only where the reference's two best logits tie
    within TIE_TOL (the two sides round differently: fused vs separate GEMMs)."""
    if ours == theirs:
        return
    pos = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt_ids + theirs[:pos]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert top2[0] - top2[1] < TIE_TOL, f"token {pos}: {ours[pos]} != {theirs[pos]}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_backend_decoder_equals_native(kind, tiny_decoder_llm, tiny_decoder_path, hf_decoder):
    native, backend = tiny_decoder_llm(kind), _backend(tiny_decoder_path(kind), **CHUNKED)
    ours, theirs = _tokens(backend, PROMPTS), _tokens(native, PROMPTS)
    for a, b, prompt in zip(ours, theirs, PROMPTS, strict=True):
        ids = backend.get_tokenizer()(prompt)["input_ids"]
        _assert_same_greedy(a.token_ids, b.token_ids, hf_decoder(kind)[0], ids)
    metrics = backend.get_metrics()
    assert metrics.prefix_cache_hits > 0  # the shared instruction was computed once
    assert metrics.num_steps > 32  # prompts ran in chunks alongside decodes
    if kind == "mistral":  # a window of 24 < max_model_len: blocks leave the window
        spec = backend.engine.kv_cache_manager.config.groups[0].spec
        assert spec.sliding_window == 24
    # LAST pooling with the body of the same *ForCausalLM checkpoint.
    path = tiny_decoder_path(kind)
    native_embed = LLM(str(path), dtype="float32", runner="pooling")
    backend_embed = _backend(path, runner="pooling", **CHUNKED)
    assert backend_embed.engine.model_runner.pooler.pooling_type == "LAST"
    assert (_embed(backend_embed, PROMPTS) - _embed(native_embed, PROMPTS)).abs().max() <= ATOL


# ----------------------------------------------------------------------------- no native model


def _modernbert_config(**extra) -> transformers.ModernBertConfig:
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    return transformers.ModernBertConfig(
        vocab_size=30522,
        num_hidden_layers=3,
        max_position_embeddings=128,
        initializer_range=0.2,
        local_attention=8,  # layers 1 and 2 see |q - k| <= 4 only
        global_attn_every_n_layers=3,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        cls_token_id=101,
        sep_token_id=102,
        **{**sizes, **extra},
    )


def _distilbert_config(**extra) -> transformers.DistilBertConfig:
    sizes = dict(dim=32, n_heads=4, hidden_dim=64)
    return transformers.DistilBertConfig(
        vocab_size=30522,
        n_layers=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        **{**sizes, **extra},
    )


ENCODERS = {
    "distilbert": lambda: transformers.DistilBertModel(_distilbert_config()),
    "distilbert-classifier": lambda: transformers.DistilBertForSequenceClassification(
        _distilbert_config(num_labels=3)
    ),
    "electra-classifier": lambda: transformers.ElectraForSequenceClassification(
        transformers.ElectraConfig(vocab_size=30522, embedding_size=16, num_labels=2, **TINY_SIZES)
    ),
    "modernbert": lambda: transformers.ModernBertModel(_modernbert_config()),
    # One attention module shared by every layer.
    "albert": lambda: transformers.AlbertModel(
        transformers.AlbertConfig(vocab_size=30522, embedding_size=16, **TINY_SIZES)
    ),
    # Checkpoint names that transformers converts on load (fused Wqkv): its loader runs.
    "nomic-bert": lambda: transformers.NomicBertModel(
        transformers.NomicBertConfig(vocab_size=30522, **TINY_SIZES)
    ),
    "modernbert-classifier": lambda: transformers.ModernBertForSequenceClassification(
        _modernbert_config(num_labels=3, classifier_pooling="mean")
    ),
}
# 32-wide heads: these run on tidepool's CPU attention kernel where it is available (ModernBERT's
# local-attention layers still take the bucketed SDPA path, over the packed rows).
WIDE_HEAD_ENCODERS = {
    "distilbert-wide-heads": lambda: transformers.DistilBertModel(
        _distilbert_config(dim=64, n_heads=2, hidden_dim=128)
    ),
    "modernbert-wide-heads": lambda: transformers.ModernBertModel(
        _modernbert_config(hidden_size=64, num_attention_heads=2, intermediate_size=128)
    ),
}
DECODERS = {
    # A window of 24 tokens: prompts and generations outgrow it.
    "phi3": ("Phi3", {"sliding_window": 24}),
    "olmo": ("Olmo", {"clip_qkv": 3.0}),
    # Its config carries num_key_value_heads=2 (from SIZES), which its attention ignores: the KV
    # cache is sized from what the layers pass (the load-time probe), not from the config.
    "gpt-neox": ("GPTNeoX", {}),
    "granite": (
        "Granite",
        {
            "logits_scaling": 4.0,
            "attention_multiplier": 0.3,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
        },
    ),
}


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory, minilm_path):
    """kind → (folder, the transformers model it was saved from, in eval mode)."""
    root = tmp_path_factory.mktemp("backend_models")
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            folder = root / kind
            folder.mkdir()
            torch.manual_seed(20 + [*ENCODERS, *DECODERS, *WIDE_HEAD_ENCODERS].index(kind))
            if kind in ENCODERS or kind in WIDE_HEAD_ENCODERS:
                copy_bert_tokenizer(minilm_path, folder)
                model = {**ENCODERS, **WIDE_HEAD_ENCODERS}[kind]()
            else:
                prefix, extra = DECODERS[kind]
                config_cls = getattr(transformers, prefix + "Config")
                config = config_cls(vocab_size=save_tokenizer(folder), **SIZES, **extra)
                model = getattr(transformers, prefix + "ForCausalLM")(config)
            model.eval().save_pretrained(str(folder))
            built[kind] = (folder, model)
        return built[kind]

    return get


@torch.inference_mode()
def _hf_states(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    body = getattr(model, model.base_model_prefix, model)
    return body(input_ids=torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize(
    "kind", ["distilbert", "modernbert", "albert", "nomic-bert", *WIDE_HEAD_ENCODERS]
)
def test_backend_encoder_matches_transformers(kind, hf_tiny, tiny_texts, report_tolerance):
    folder, hf = hf_tiny(kind)
    llm = LLM(str(folder), device="cpu", dtype="float32")  # auto: no native model
    assert llm.model_config.model_impl == "transformers" and not llm.model_config.is_causal
    if kind in WIDE_HEAD_ENCODERS:
        model = llm.engine.model_runner.model
        llm.embed(tiny_texts[:1], use_tqdm=False)
        uses_kernel = model.attention_backend is CPU_KERNEL
        assert uses_kernel == cpu_kernels.supports(torch.device("cpu"), torch.float32, 32)
    outs = llm.encode(tiny_texts, RAW, pooling_task="token_embed", use_tqdm=False)
    for out in outs:
        expected = _hf_states(hf, out.prompt_token_ids)
        measured = report_tolerance(f"backend tiny {kind} token_embed", out.outputs.data, expected)
        assert measured.max_abs_diff <= ATOL
    assert len(max(outs, key=lambda o: len(o.prompt_token_ids)).prompt_token_ids) > 8  # > window
    cls = torch.stack([_hf_states(hf, o.prompt_token_ids)[0] for o in outs])
    assert (_embed(llm, tiny_texts) - cls).abs().max() <= ATOL  # CLS by default, as native
    # sentence-transformers metadata is honoured: MEAN pooling, then Normalize.
    mean_folder = folder.parent / f"{kind}-st-mean"
    if not mean_folder.exists():
        shutil.copytree(folder, mean_folder)
        write_st_metadata(mean_folder, {"pooling_mode": "mean"}, normalize=True)
    st = LLM(str(mean_folder), device="cpu", dtype="float32")
    got = torch.tensor([o.outputs.embedding for o in st.embed(tiny_texts, use_tqdm=False)])
    expected = torch.stack([_hf_states(hf, o.prompt_token_ids).mean(0) for o in outs])
    assert (got - F.normalize(expected, dim=-1)).abs().max() <= ATOL


@pytest.mark.parametrize(
    "kind", ["distilbert-classifier", "electra-classifier", "modernbert-classifier"]
)
def test_backend_classifier_matches_transformers(kind, hf_tiny, tiny_texts, report_tolerance):
    """The HF head runs on our pooled states: DistilBERT's pre_classifier + ReLU, ELECTRA's
    dense + GELU + out_proj, ModernBERT's MEAN pooling + head."""
    folder, hf = hf_tiny(kind)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.task == "classify"
    outs = llm.classify(tiny_texts, use_tqdm=False)
    got = torch.tensor([o.outputs.probs for o in outs])
    with torch.inference_mode():
        logits = torch.cat([hf(input_ids=torch.tensor([o.prompt_token_ids])).logits for o in outs])
    measured = report_tolerance(f"backend tiny {kind} probs", got, logits.softmax(-1))
    assert measured.max_abs_diff <= ATOL


@pytest.mark.parametrize("kind", ["phi3", "olmo", "granite", "gpt-neox"])
def test_backend_decoder_matches_transformers(kind, hf_tiny, report_tolerance):
    folder, hf = hf_tiny(kind)
    llm = LLM(str(folder), device="cpu", dtype="float32", **CHUNKED)
    assert llm.model_config.model_impl == "transformers" and llm.model_config.is_causal
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        ref_tokens = ref.sequences[0, len(ids) :].tolist()
        _assert_same_greedy(out.outputs[0].token_ids, ref_tokens, hf, ids)
        if out.outputs[0].token_ids == ref_tokens:
            # The head as HF runs it (Granite divides its logits by logits_scaling).
            ref_logprobs = torch.cat(ref.scores).log_softmax(-1)
            ours = torch.tensor(
                [
                    step[t].logprob
                    for step, t in zip(out.outputs[0].logprobs, ref_tokens, strict=True)
                ]
            )
            theirs = ref_logprobs[torch.arange(len(ref_tokens)), ref_tokens]
            assert (ours - theirs).abs().max() <= 1e-4
    assert llm.get_metrics().prefix_cache_hits > 0
    if kind == "phi3":
        assert llm.engine.kv_cache_manager.config.groups[0].spec.sliding_window == 24
    # LAST pooling with the body (runner="pooling" on the *ForCausalLM checkpoint).
    embedder = LLM(str(folder), device="cpu", dtype="float32", runner="pooling", **CHUNKED)
    assert embedder.model_config.architecture == DECODERS[kind][0] + "Model"
    texts = PROMPTS + PROMPTS[:2]  # the repeats are served from the prefix cache
    got = _embed(embedder, texts)
    ids = [embedder.get_tokenizer()(t)["input_ids"] for t in texts]
    expected = torch.stack([_hf_states(hf, x)[-1] for x in ids])
    assert report_tolerance(f"backend tiny {kind} LAST", got, expected).max_abs_diff <= ATOL


@pytest.mark.parametrize("pad_token_id", [0, None])
def test_backend_decoder_classifier_matches_transformers(pad_token_id, tmp_path):
    """LlamaForSequenceClassification: LAST pooling, then HF's score head; without a pad id HF
    refuses batches, so the head runs one row at a time."""
    vocab_size = save_tokenizer(tmp_path)
    sizes = {**SIZES, "pad_token_id": pad_token_id}
    config = transformers.LlamaConfig(vocab_size=vocab_size, num_labels=3, **sizes)
    torch.manual_seed(30)
    hf = transformers.LlamaForSequenceClassification(config).eval()
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", **CHUNKED)
    assert llm.model_config.task == "classify" and llm.model_config.is_causal
    outs = llm.classify(PROMPTS, use_tqdm=False)
    with torch.inference_mode():
        logits = torch.cat([hf(input_ids=torch.tensor([o.prompt_token_ids])).logits for o in outs])
    got = torch.tensor([o.outputs.probs for o in outs])
    assert (got - logits.softmax(-1)).abs().max() <= ATOL


# ----------------------------------------------------------------------------- errors


def test_model_impl_choices(tiny_model_path, hf_tiny):
    with pytest.raises(ValueError, match="model_impl must be one of"):
        LLM(str(tiny_model_path("bert")), model_impl="bogus")
    # vLLM's name for its own implementations is tidepool's native one.
    assert LLM(str(tiny_model_path("bert")), model_impl="vllm").model_config.model_impl == "native"
    folder, _ = hf_tiny("distilbert")
    with pytest.raises(ValueError, match="no implementation in tidepool"):
        LLM(str(folder), model_impl="native")


def test_embedding_body_of_a_checkpoint_with_any_head(tmp_path, tiny_llm, tiny_model_path):
    """No native BertLMHeadModel: auto takes the backend, which builds the bare BertModel."""
    folder = tmp_path / "lm-head"
    shutil.copytree(tiny_model_path("bert"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertLMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "transformers" and llm.model_config.task == "embed"
    texts = ["hi", "The quick brown fox jumps over the lazy dog."]
    assert (_embed(llm, texts) - _embed(tiny_llm("bert"), texts)).abs().max() <= ATOL


def test_unsupported_attention_is_refused(tmp_path, minilm_path):
    """MPNet adds a relative position bias inside its attention: not through the interface."""
    copy_bert_tokenizer(minilm_path, tmp_path)
    config = transformers.MPNetConfig(vocab_size=30522, **TINY_SIZES)
    transformers.MPNetModel(config).save_pretrained(str(tmp_path))
    # auto runs MPNet natively now; the backend alone (strict) still refuses it.
    with pytest.raises(UnsupportedAttentionError, match="MPNetModel does not declare support"):
        LLM(str(tmp_path), device="cpu", model_impl="transformers")


def test_attention_chosen_by_name_is_refused(tmp_path):
    """Falcon picks attention classes by implementation name, bypassing the interface (newer
    transformers also stop declaring the attention interface for it: refused either way)."""
    vocab_size = save_tokenizer(tmp_path)
    config = transformers.FalconConfig(vocab_size=vocab_size, **SIZES)
    torch.manual_seed(0)
    transformers.FalconForCausalLM(config).save_pretrained(str(tmp_path))
    refused = "chooses its attention classes by|does not declare support for custom attention"
    with pytest.raises(UnsupportedAttentionError, match=refused):
        LLM(str(tmp_path), device="cpu")


_REMOTE_CODE = """
from transformers import BertModel


class KwargsFreeBertModel(BertModel):
    def forward(self, input_ids=None, position_ids=None, token_type_ids=None):
        return super().forward(
            input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids
        )
"""


def test_remote_code_needs_trust_and_kwargs(tmp_path, tiny_model_path):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model_path("bert"), folder)
    (folder / "modeling_kwargs_free.py").write_text(_REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["KwargsFreeBertModel"]
    config["auto_map"] = {"AutoModel": "modeling_kwargs_free.KwargsFreeBertModel"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        LLM(str(folder), device="cpu")
    # Strict backend (auto would run it on the fallback: transformers_backend/fallback.py).
    with pytest.raises(UnsupportedAttentionError, match=r"takes no \*\*kwargs"):
        LLM(str(folder), device="cpu", trust_remote_code=True, model_impl="transformers")
