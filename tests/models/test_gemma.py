"""Native Gemma 2 / Gemma 3 (text) vs transformers' eager modeling code, float32 on CPU.

Tiny random models (hidden 64, head_dim 16, GQA 4/2, sliding window 8, block_size 4) with prompts of
~45-95 tokens, so every sliding-window layer drops keys and blocks. The RMSNorm weights are drawn at
random (transformers initialises them to 0, where Gemma's (1 + weight) would test nothing), and
query_pre_attn_scalar (24) differs from head_dim (16), so a wrong attention scale shows.

Gemma 2 caps attention logits at 5 and final logits at 3 (real checkpoints: 50 and 30), with q/k
weights scaled up so that scores reach the cap: removing either cap moves the log-probabilities by
far more than the tolerance (asserted below).
Gemma 3: sliding/full pattern 3 (S S F S S F: three KV-cache groups of two layers), a local RoPE base
of 100 against a global 10,000 with linear scaling, q/k norms; its config sets
attn_logit_softcapping, which transformers' Gemma 3 ignores, and so must we.

Tolerances: logits and log-probabilities 5e-5, hidden states 1e-5 (measured ~3e-6: float32
summation order differs between the packed/paged path and transformers' padded eager one; logits
are O(1), capped at 3). Greedy tokens equal transformers' `generate` unless its two best logits
tie within 1e-4.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidepool import LLM, PoolingParams, SamplingParams

TIE_TOL = 1e-4
LOGIT_ATOL = 5e-5
HIDDEN_ATOL = 1e-5
BLOCK_SIZE = 4
WINDOW = 8
MAX_TOKENS = 24
RAW = PoolingParams(normalize=False)
LOGPROBS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS)


def _corpus() -> list[str]:
    from tiny_decoders import CORPUS

    return CORPUS


def _prompts() -> list[str]:
    c = _corpus()
    return [c[3] + " " + c[4] + " " + c[5], c[2] + " " + c[0], c[6] + " " + c[7] + " " + c[1], c[1]]


GEMMA_COMMON = dict(
    num_hidden_layers=4,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    initializer_range=0.05,
)
# kind → (config class, model class, config overrides, seed)
KINDS: dict[str, tuple[str, str, dict, int]] = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        31,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            sliding_window_pattern=3,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            rope_local_base_freq=100.0,
            attn_logit_softcapping=5.0,  # ignored by transformers' Gemma 3, and by ours
            final_logit_softcapping=3.0,
        ),
        32,
    ),
    "gemma2-embed": ("Gemma2Config", "Gemma2Model", {}, 33),
    "gemma3-embed": ("Gemma3TextConfig", "Gemma3TextModel", dict(sliding_window_pattern=2), 34),
}
# q_proj / k_proj weights times this: attention scores of a few units, where a cap of 5 bends them
# (at initializer_range 0.05 they stay ~0.1 and tanh(0.1 / 5) is the identity to 1e-4).
QK_GAIN = {"gemma2": 5.0}


def _build(kind: str, folder: Path):
    import transformers
    from tiny_decoders import SIZES, save_tokenizer

    config_name, model_name, extra, seed = KINDS[kind]
    folder.mkdir(parents=True)
    vocab_size = save_tokenizer(folder)
    sizes = dict(SIZES, **GEMMA_COMMON)
    sizes.update(extra)
    config = getattr(transformers, config_name)(vocab_size=vocab_size, **sizes)
    config._attn_implementation = "eager"  # soft-capping needs it; SDPA would silently skip it
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
            if "q_proj" in name or "k_proj" in name:
                param.mul_(QK_GAIN.get(kind, 1.0))
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """kind → (folder, transformers model in float32 eval mode with eager attention)."""
    root = tmp_path_factory.mktemp("tiny_gemma")
    built: dict[str, tuple[Path, object]] = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = (root / kind, _build(kind, root / kind))
        return built[kind]

    return get


@pytest.fixture(scope="module")
def chunked_llm(gemma):
    """kind → LLM with 4-token blocks, 16-token steps (chunked prefill), prefix caching on."""
    engines: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in engines:
            engines[kind] = LLM(
                str(gemma(kind)[0]),
                dtype="float32",
                block_size=BLOCK_SIZE,
                max_num_batched_tokens=16,
                enable_prefix_caching=True,
            )
        return engines[kind]

    return get


def _ids(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.get_tokenizer()(t)["input_ids"] for t in texts]


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat(out.logits)


@torch.inference_mode()
def _hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one full forward (no KV cache): [len, vocab]."""
    return model(torch.tensor([token_ids])).logits[0].float()


def _assert_same_greedy(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> int:
    """Positions compared before a legitimate divergence (a near-tie in the reference)."""
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = ref_logits[pos].topk(2).values
            assert top2[0] - top2[1] < TIE_TOL, f"token {pos}: {a} != {b} (no tie: {top2.tolist()})"
            return pos
    return len(ours)


def _logprob_table(out) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of every (position, token) our engine reported, flattened."""
    ids, values = [], []
    for position in out.outputs[0].logprobs:
        for token_id, logprob in position.items():
            ids.append(token_id)
            values.append(logprob.logprob)
    return ids, values


def _generate_and_compare(llm: LLM, hf_model, prompts: list[str], report, name: str):
    """Greedy tokens vs transformers' generate; our top log-probs at the last prompt token and
    every decode step vs log_softmax of transformers' logits on prompt + our tokens."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt_ids, out in zip(_ids(llm, prompts), outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == MAX_TOKENS and len(out.outputs[0].logprobs) == MAX_TOKENS
        ref, ref_step_logits = _hf_greedy(hf_model, prompt_ids, MAX_TOKENS)
        _assert_same_greedy(ours, ref, ref_step_logits)
        ref_logprobs = torch.log_softmax(_hf_logits(hf_model, prompt_ids + ours[:-1]), dim=-1)
        ref_logprobs = ref_logprobs[len(prompt_ids) - 1 :]  # [MAX_TOKENS, vocab]
        got, expected = [], []
        for step, position in enumerate(out.outputs[0].logprobs):
            assert len(position) >= LOGPROBS
            for token_id, logprob in position.items():
                got.append(logprob.logprob)
                expected.append(ref_logprobs[step, token_id].item())
        measured = report(name, torch.tensor([got]), torch.tensor([expected]))
        assert measured.max_abs_diff <= LOGIT_ATOL, measured
    return outs


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_greedy_generation_and_logprobs_match_transformers(
    kind, gemma, chunked_llm, report_tolerance
):
    llm, hf_model = chunked_llm(kind), gemma(kind)[1]
    assert llm.model_config.architecture == KINDS[kind][1]
    assert all(len(ids) >= 40 for ids in _ids(llm, _prompts()[:3]))
    # All prompts at once: 16-token steps mix prefill chunks with other requests' decodes.
    _generate_and_compare(llm, hf_model, _prompts(), report_tolerance, f"tiny {kind} logprobs")
    assert llm.get_metrics().num_steps > MAX_TOKENS + 10  # the prompts took several steps
    groups = llm.engine.kv_cache_manager.config.groups
    layer_types = hf_model.config.layer_types
    full = tuple(f"layers.{i}" for i, t in enumerate(layer_types) if t == "full_attention")
    sliding = [f"layers.{i}" for i, t in enumerate(layer_types) if t == "sliding_attention"]
    assert (
        groups[0].layer_names == full and groups[0].spec.__class__.__name__ == "FullAttentionSpec"
    )
    assert [name for g in groups[1:] for name in g.layer_names] == sliding
    assert all(g.spec.sliding_window == WINDOW for g in groups[1:])


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_prompt_logits_match_transformers(kind, gemma, chunked_llm, report_tolerance):
    """Every prompt position: the body's hidden states over 6-token chunks (token_embed), through
    the causal LM's soft-capped head, vs transformers' logits of one full forward."""
    path, hf_model = gemma(kind)
    lm = chunked_llm(kind).engine.model_runner.model
    body = LLM(
        str(path),
        runner="pooling",
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=6,
    )
    assert body.model_config.architecture == type(hf_model.model).__name__
    prompts = _prompts()
    outs = body.encode(prompts, pooling_task="token_embed", pooling_params=RAW, use_tqdm=False)
    for prompt_ids, out in zip(_ids(body, prompts), outs, strict=True):
        with torch.inference_mode():
            got = lm.compute_logits(out.outputs.data)
        expected = _hf_logits(hf_model, prompt_ids)
        measured = report_tolerance(f"tiny {kind} prompt logits", got, expected)
        assert measured.max_abs_diff <= LOGIT_ATOL, measured


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_prefix_cache_hit_keeps_outputs_equal(kind, gemma, report_tolerance):
    path, hf_model = gemma(kind)
    shared = _prompts()[0]  # ~75 tokens: far past the window
    first, second = shared + " Query: what is a KV cache?", shared + " Paris is the capital."
    on = LLM(str(path), dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    off = LLM(str(path), dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=False)
    on.generate([first], GREEDY, use_tqdm=False)
    hits_before = on.get_metrics().prefix_cache_hits
    assert hits_before == 0
    outs = _generate_and_compare(on, hf_model, [second], report_tolerance, f"tiny {kind} logprobs")
    first_ids, second_ids = _ids(on, [first, second])
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    # Every group serves the shared full blocks: the full-attention one from block 0, the
    # sliding-window ones the blocks inside the window before the hit's end (the rest were freed
    # as the first request moved on, but stay cached until evicted).
    expected_hit = min(common, len(second_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_hit >= 64
    assert on.get_metrics().prefix_cache_hits == expected_hit
    reference = off.generate([second], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    got, expected = _logprob_table(outs[0])[1], _logprob_table(reference[0])[1]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= LOGIT_ATOL


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_hybrid_and_uniform_kv_layouts_give_identical_outputs(kind, gemma):
    path = str(gemma(kind)[0])
    kwargs = dict(dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    hybrid = LLM(path, **kwargs)
    uniform = LLM(path, disable_hybrid_kv_cache_manager=True, **kwargs)
    assert len(hybrid.engine.kv_cache_manager.config.groups) > 1
    assert len(uniform.engine.kv_cache_manager.config.groups) == 1
    prompts = _prompts()
    outs_h = hybrid.generate(prompts, GREEDY, use_tqdm=False)
    outs_u = uniform.generate(prompts, GREEDY, use_tqdm=False)
    for out_h, out_u in zip(outs_h, outs_u, strict=True):
        assert out_h.outputs[0].token_ids == out_u.outputs[0].token_ids
        ids_h, values_h = _logprob_table(out_h)
        ids_u, values_u = _logprob_table(out_u)
        assert ids_h == ids_u
        assert max(abs(a - b) for a, b in zip(values_h, values_u, strict=True)) <= 1e-5


def _cdiv(num: int, den: int) -> int:
    return -(-num // den)


def test_sliding_window_layers_hold_fewer_blocks(gemma, monkeypatch):
    """Ask the KV manager at every step of a ~95-token prompt: the full-attention group holds a
    block for every token, a sliding-window group only those a next token can still attend to."""
    llm = LLM(
        str(gemma("gemma2")[0]), dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=16
    )
    kv = llm.engine.kv_cache_manager
    runner = llm.engine.model_runner
    execute = runner.execute
    seen: list[tuple[int, int, int, int]] = []

    def inspecting(sched_out):
        for request in sched_out.scheduled:
            full, sliding = kv.get_block_ids(request.request_id)
            num_tokens = (
                request.num_computed_tokens + sched_out.num_scheduled_tokens[request.request_id]
            )
            assert len(full) == len(sliding) == _cdiv(num_tokens, BLOCK_SIZE)
            assert 0 not in full
            # Kept: the block of the first key the step's first query sees, and all after it.
            first_kept = max(request.num_computed_tokens - WINDOW + 1, 0) // BLOCK_SIZE
            assert sliding[:first_kept] == [0] * first_kept and 0 not in sliding[first_kept:]
            seen.append((num_tokens, len(full), len(sliding) - first_kept, first_kept))
        return execute(sched_out)

    monkeypatch.setattr(runner, "execute", inspecting)
    prompt = _prompts()[2]
    llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    num_tokens, num_full, num_sliding, _ = seen[-1]
    assert num_tokens >= 90 and num_full == _cdiv(num_tokens, BLOCK_SIZE)
    assert num_sliding <= _cdiv(WINDOW, BLOCK_SIZE) + 1 < num_full / 5
    assert max(s for _, _, s, _ in seen) <= _cdiv(WINDOW - 1 + 16, BLOCK_SIZE) + 1


def test_soft_capping_is_exercised(gemma, chunked_llm, monkeypatch):
    """Removing either cap from our Gemma 2 moves its outputs by far more than the tolerance, so
    the match with transformers above really checks both caps."""
    llm = chunked_llm("gemma2")
    model = llm.engine.model_runner.model
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=LOGPROBS)

    def first_logprobs() -> list[float]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [lp.logprob for o in outs for lp in o.outputs[0].logprobs[0].values()]

    capped = first_logprobs()
    assert model.final_logit_softcap == 3.0
    assert {layer.self_attn.softcap for layer in model.model.layers} == {5.0}
    with monkeypatch.context() as patch:
        for layer in model.model.layers:
            patch.setattr(layer.self_attn, "softcap", None)
        no_attn_cap = first_logprobs()
    with monkeypatch.context() as patch:
        patch.setattr(model, "final_logit_softcap", None)
        no_final_cap = first_logprobs()
    for changed in (no_attn_cap, no_final_cap):
        diff = max(abs(a - b) for a, b in zip(capped, changed, strict=False))
        assert diff > 100 * LOGIT_ATOL, diff
    assert first_logprobs() == capped  # restored


@torch.inference_mode()
def _hf_last_hidden(model, token_ids: list[int]) -> torch.Tensor:
    body = getattr(model, "model", model)
    return body(torch.tensor([token_ids])).last_hidden_state[0, -1]


@pytest.mark.parametrize(
    "kind,runner",
    [("gemma2-embed", "auto"), ("gemma3-embed", "auto"), ("gemma3", "pooling")],
)
def test_last_pooling_embedder_matches_transformers(kind, runner, gemma, report_tolerance):
    """A causal Gemma embedder (LAST pooling) over 8-token chunks, raw and normalized; a
    Gemma3ForCausalLM checkpoint embeds with its Gemma3TextModel body (runner='pooling')."""
    path, hf_model = gemma(kind)
    llm = LLM(
        str(path), runner=runner, dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=8
    )
    assert llm.model_config.task == "embed"
    assert llm.model_config.architecture in ("Gemma2Model", "Gemma3TextModel")
    assert llm.engine.model_runner.pooler.pooling_type == "LAST"
    texts = _prompts() + [c + " " + _corpus()[2] for c in _corpus()[:3]]
    expected = torch.stack([_hf_last_hidden(hf_model, ids) for ids in _ids(llm, texts)])
    raw = llm.embed(texts, pooling_params=RAW, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in raw])
    measured = report_tolerance(f"tiny {kind} LAST raw", got, expected)
    assert measured.max_abs_diff <= HIDDEN_ATOL, measured
    normalized = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    measured = report_tolerance(f"tiny {kind} LAST normalized", normalized, F.normalize(expected))
    assert measured.worst_cosine > 1 - 1e-9 and measured.max_abs_diff <= 1e-6
    assert all(math.isclose(v.norm().item(), 1.0, abs_tol=1e-6) for v in normalized)
