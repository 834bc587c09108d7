"""Tiny random causal decoders: tidepool vs transformers, float32 on CPU.

Generation: greedy tokens equal transformers' `generate` token for token; where the two best
logits of the reference tie within 1e-4 (rounding may pick either), a divergence from that
position on is allowed. Pooling: LAST / MEAN equal transformers' hidden states to 1e-5. Then the
engine features must not change any output: prefix caching on vs off, chunked prefill with a tiny
budget vs one-shot, a KV cache too small for all requests at once (preemption).
"""

from __future__ import annotations

import pytest
import torch

from tidepool import LLM, PoolingParams, SamplingParams

TIE_TOL = 1e-4
ATOL = 1e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
RAW = PoolingParams(normalize=False)
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital and most populous city of France. Paged attention stores keys",
    "Hello",
    "Chunked prefill splits a long prompt over several engine steps. " * 3,
]
INSTRUCTION = "Instruct: retrieve passages that answer the question.\nQuery: "
QUERIES = ["what is a KV cache?", "Paris", "how do blocks work", "chunked prefill", "the fox"]


@torch.inference_mode()
def _hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of transformers' generate (no EOS stop) and the logits of each step."""
    model, _ = hf
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat(out.scores)


def _assert_same_greedy(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> None:
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = ref_logits[pos].topk(2).values
            assert top2[0] - top2[1] < TIE_TOL, f"token {pos}: {a} != {b} (no tie: {top2.tolist()})"
            return  # a near-tie: the rest may legitimately differ


def _ids(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.get_tokenizer()(t)["input_ids"] for t in texts]


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        "llama-llama3-rope",
        "llama-linear-rope",
        "mistral",
        "qwen2",
        "qwen2-hybrid",
        "qwen3",
    ],
)
def test_greedy_generation_matches_transformers(kind, tiny_decoder_llm, hf_decoder):
    llm, hf = tiny_decoder_llm(kind), hf_decoder(kind)
    assert llm.model_config.task == "generate" and llm.model_config.is_causal
    # All prompts in one engine run: continuous batching, decodes mixed with prefills.
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt_ids, out in zip(_ids(llm, PROMPTS), outs, strict=True):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 32
        ref, ref_logits = _hf_greedy(hf, prompt_ids, 32)
        _assert_same_greedy(out.outputs[0].token_ids, ref, ref_logits)
    groups = llm.engine.kv_cache_manager.config.groups
    if kind == "mistral":
        # Sliding window of 24: the longest request outgrew it, so blocks left the window.
        assert groups[0].spec.sliding_window == 24
    if kind == "qwen2-hybrid":
        # A full-attention group and a sliding-window group share one block pool.
        assert [g.layer_names for g in groups] == [("layers.0",), ("layers.1",)]
        assert groups[1].spec.sliding_window == 16


@torch.inference_mode()
def _hf_hidden(hf, text: str) -> torch.Tensor:
    model, tokenizer = hf
    body = model.model if hasattr(model, "lm_head") else model
    return body(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]


def test_last_pooling_matches_transformers(tiny_decoder_llm, hf_decoder, report_tolerance):
    for kind in ("llama-embed", "qwen3-embed"):
        llm, hf = tiny_decoder_llm(kind), hf_decoder(kind)
        assert llm.model_config.task == "embed"
        assert llm.engine.model_runner.pooler.pooling_type == "LAST"
        texts = [INSTRUCTION + q for q in QUERIES] + PROMPTS
        got = torch.tensor(
            [o.outputs.embedding for o in llm.embed(texts, pooling_params=RAW, use_tqdm=False)]
        )
        expected = torch.stack([_hf_hidden(hf, t)[-1] for t in texts])
        measured = report_tolerance(f"tiny {kind} LAST raw", got, expected)
        assert measured.max_abs_diff <= ATOL
        normalized = llm.embed(texts[:2], use_tqdm=False)  # vLLM's default: L2-normalized
        assert abs(torch.tensor(normalized[0].outputs.embedding).norm().item() - 1) < 1e-6


def test_causal_lm_as_embedder_and_mean_pooling(tiny_decoder_path, hf_decoder, report_tolerance):
    """e5-mistral style: a *ForCausalLM checkpoint embeds with its body (runner='pooling');
    MEAN pooling (sentence-transformers config) averages every prompt token, over chunks."""
    import shutil

    from tiny_decoders import write_st_pooling

    path = tiny_decoder_path("qwen2")
    llm = LLM(str(path), runner="pooling", dtype="float32")
    assert llm.model_config.architecture == "Qwen2Model" and llm.model_config.task == "embed"
    texts = PROMPTS + [INSTRUCTION + q for q in QUERIES]
    expected_last = torch.stack([_hf_hidden(hf_decoder("qwen2"), t)[-1] for t in texts])
    got = torch.tensor(
        [o.outputs.embedding for o in llm.embed(texts, pooling_params=RAW, use_tqdm=False)]
    )
    assert report_tolerance("tiny qwen2 body LAST raw", got, expected_last).max_abs_diff <= ATOL

    mean_path = path.parent / "qwen2-mean"
    if not mean_path.exists():
        shutil.copytree(path, mean_path)
        write_st_pooling(mean_path, "mean")
    expected = torch.stack([_hf_hidden(hf_decoder("qwen2"), t).mean(0) for t in texts])
    for budget in (None, 8):  # one shot, then 8-token chunks (MEAN accumulates over chunks)
        llm = LLM(str(mean_path), runner="pooling", dtype="float32", max_num_batched_tokens=budget)
        got = torch.tensor(
            [o.outputs.embedding for o in llm.embed(texts, pooling_params=RAW, use_tqdm=False)]
        )
        assert report_tolerance("tiny qwen2 MEAN raw", got, expected).max_abs_diff <= ATOL
        assert llm.get_metrics().prefix_cache_hits == 0  # MEAN needs every token: no reads


def _embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    return torch.tensor(
        [o.outputs.embedding for o in llm.embed(texts, pooling_params=RAW, use_tqdm=False)]
    )


def test_prefix_caching_on_off_same_outputs_and_expected_hits(tiny_decoder_path):
    path = str(tiny_decoder_path("llama-embed"))
    texts = [INSTRUCTION + q for q in QUERIES]
    on = LLM(path, dtype="float32", enable_prefix_caching=True)
    off = LLM(path, dtype="float32", enable_prefix_caching=False)
    emb_on, emb_off = _embed(on, texts), _embed(off, texts)
    assert (emb_on - emb_off).abs().max() <= ATOL
    # The shared instruction is computed once: every later query hits its full blocks, in the same
    # step as the first (blocks are cached when allocated, KV written before it is read).
    ids = _ids(on, texts)
    common = next(i for i, column in enumerate(zip(*ids, strict=False)) if len(set(column)) > 1)
    per_query = min(common // 16, (min(len(x) for x in ids) - 1) // 16) * 16
    metrics = on.get_metrics()
    assert per_query >= 16
    assert metrics.prefix_cache_hits == per_query * (len(texts) - 1)
    assert metrics.prefix_cache_queries == sum(len(x) for x in ids)
    assert off.get_metrics().prefix_cache_hits == 0
    # Again: now every query hits (its own blocks too, all but the last token's block).
    again = _embed(on, texts)
    assert (again - emb_on).abs().max() <= ATOL
    expected_second = sum((len(x) - 1) // 16 * 16 for x in ids)
    assert on.get_metrics().prefix_cache_hits - metrics.prefix_cache_hits == expected_second


@pytest.mark.parametrize("kind", ["qwen3", "qwen2-hybrid"])
def test_prefix_caching_and_chunking_keep_generation_equal(kind, tiny_decoder_path):
    path = str(tiny_decoder_path(kind))
    prompts = [INSTRUCTION + q for q in QUERIES] + PROMPTS
    reference = None
    for kwargs in (
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, max_num_batched_tokens=8),  # prompts over several steps
        dict(enable_prefix_caching=False, max_num_batched_tokens=5, max_num_seqs=3),
        # Uniform layout: sliding-window layers keep every block and still attend in the window.
        dict(disable_hybrid_kv_cache_manager=True, max_num_batched_tokens=8),
    ):
        llm = LLM(path, dtype="float32", **kwargs)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        if reference is None:
            reference = tokens
        assert tokens == reference, kwargs
        metrics = llm.get_metrics()
        assert metrics.generation_tokens == 32 * len(prompts)
        if kwargs.get("max_num_batched_tokens"):
            assert metrics.num_steps > 32  # prefill chunks ran alongside decodes


def test_chunked_prefill_embedding_equals_one_shot(tiny_decoder_path):
    path = str(tiny_decoder_path("llama-embed"))
    texts = PROMPTS + [INSTRUCTION + q for q in QUERIES]
    one_shot = _embed(LLM(path, dtype="float32"), texts)
    chunked_llm = LLM(path, dtype="float32", max_num_batched_tokens=6, enable_prefix_caching=False)
    chunked = _embed(chunked_llm, texts)
    assert (chunked - one_shot).abs().max() <= ATOL
    longest = max(len(x) for x in _ids(chunked_llm, texts))
    assert chunked_llm.get_metrics().num_steps >= sum(len(x) for x in _ids(chunked_llm, texts)) // 6
    assert longest > 6


def test_small_kv_cache_preempts_and_finishes_everything(tiny_decoder_path):
    path = str(tiny_decoder_path("llama"))
    prompts = PROMPTS + [INSTRUCTION + q for q in QUERIES]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids
        for o in LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    ]
    # One block = 2 layers x [2, 2 heads, 16 tokens, 16 dims] float32 = 8 KiB; 14 usable blocks
    # hold 224 tokens, while the 9 requests need ~700 at once.
    with pytest.raises(ValueError, match="lower max_model_len"):  # 512 tokens do not fit
        LLM(path, dtype="float32", kv_cache_memory_bytes=15 * 8192)
    small = LLM(path, dtype="float32", kv_cache_memory_bytes=15 * 8192, max_model_len=128)
    assert small.engine.kv_cache_manager.config.num_blocks == 15
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    metrics = small.get_metrics()
    assert metrics.num_preemptions > 0
    assert metrics.num_requests_running == metrics.num_requests_waiting == 0
    assert metrics.kv_cache_usage == 0.0


def test_token_embed_over_chunks_matches_transformers(tiny_decoder_path, hf_decoder):
    """token_embed needs every token's state: no prefix-cache reads, chunks concatenated."""
    path = str(tiny_decoder_path("llama-embed"))
    texts = [INSTRUCTION + QUERIES[0], PROMPTS[3]]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=7)
    for _ in range(2):  # the second time, the prompts' blocks are cached: still no reads
        outs = llm.encode(texts, pooling_task="token_embed", pooling_params=RAW, use_tqdm=False)
        for text, out in zip(texts, outs, strict=True):
            expected = _hf_hidden(hf_decoder("llama-embed"), text)
            assert out.outputs.data.shape == expected.shape
            assert (out.outputs.data - expected).abs().max() <= ATOL
    assert llm.get_metrics().prefix_cache_hits == 0


def test_kv_cache_sizing_arguments(tiny_decoder_path, monkeypatch):
    path = str(tiny_decoder_path("llama"))
    # The fraction is of the whole machine's memory minus what is in use: pin a machine with
    # 16 GiB, 15 free, so the test does not depend on what else runs (it failed under CI
    # beside a benchmark holding a few GiB).
    from tidepool.kv_cache import spec

    monkeypatch.setattr(spec, "device_memory_bytes", lambda device: (15 << 30, 16 << 30))
    # One block: 2 layers x [2, 2 heads, 16 tokens, 16 dims] float32 = 8 KiB.
    by_bytes = LLM(path, dtype="float32", kv_cache_memory_bytes=100 * 8192)
    assert by_bytes.engine.kv_cache_manager.config.num_blocks == 100
    # A share of the machine's memory: capped at what max_num_seqs full requests can hold.
    by_share = LLM(path, dtype="float32", kv_cache_memory_fraction=0.9, max_num_seqs=4)
    assert by_share.engine.kv_cache_manager.config.num_blocks == 4 * (512 // 16) + 1
    with pytest.raises(ValueError, match="not both"):
        LLM(path, kv_cache_memory_bytes=1 << 20, kv_cache_memory_fraction=0.5)


def test_failed_step_leaves_no_unwritten_blocks_in_the_prefix_cache(tiny_decoder_path, monkeypatch):
    path = str(tiny_decoder_path("llama-embed"))
    llm = LLM(path, dtype="float32")
    texts = [INSTRUCTION + QUERIES[0]]
    expected = _embed(LLM(path, dtype="float32"), texts)
    runner = llm.engine.model_runner
    execute = runner.execute

    def failing(sched_out):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "execute", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.embed(texts, use_tqdm=False)
    monkeypatch.setattr(runner, "execute", execute)
    hits_before = llm.get_metrics().prefix_cache_hits
    assert (_embed(llm, texts) - expected).abs().max() <= ATOL
    assert llm.get_metrics().prefix_cache_hits == hits_before  # nothing served from the failure
    assert (
        llm.engine.kv_cache_manager.get_num_free_blocks()
        == llm.get_metrics().kv_cache_num_blocks - 1
    )
