"""vLLM 0.32's documented offline pooling usage, run against tidepool with `vllm` replaced by
`tidepool` (embed, classify, score 1-to-N / N-to-N, encode per task, token-id prompts,
dimensions, tokenization_kwargs, PoolerConfig, EngineArgs' CLI, AsyncLLMEngine).

Where tidepool chooses to differ, the test says so (docs/coming_from_vllm.md lists each)."""

from __future__ import annotations

import asyncio
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from tidepool import (
    LLM,
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineArgs,
    PoolingParams,
    TextPrompt,
    TokensPrompt,
)
from tidepool.config import PoolerConfig
from tidepool.engine.args import engine_args_from_vllm
from tidepool.engine.vllm_args import VLLM_ARGS
from tidepool.utils.argparse_utils import FlexibleArgumentParser

TEXTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]

# vLLM 0.32's LLM.__init__ keywords (its signature; **kwargs go to EngineArgs).
VLLM_LLM_ARGS = (
    "runner convert tokenizer tokenizer_mode skip_tokenizer_init trust_remote_code "
    "allowed_local_media_path allowed_media_domains tensor_parallel_size dtype quantization "
    "revision tokenizer_revision seed gpu_memory_utilization swap_space cpu_offload_gb "
    "enforce_eager disable_custom_all_reduce hf_token hf_overrides mm_processor_kwargs "
    "pooler_config structured_outputs_config profiler_config attention_config "
    "kv_cache_memory_bytes compilation_config logits_processors task download_dir load_format "
    "max_logprobs max_model_len max_num_seqs max_num_batched_tokens block_size "
    "enable_prefix_caching enable_chunked_prefill model_impl"
).split()


@pytest.fixture(scope="module")
def embedder(tiny_model_path) -> LLM:
    # No sentence-transformers files: normalized embeddings, as vLLM's default. (A pipeline
    # without a Normalize module is not normalized, in vLLM and tidepool alike.)
    return LLM(str(tiny_model_path("bert")), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def cross_encoder(tiny_model_path) -> LLM:
    return LLM(str(tiny_model_path("bert-cross-encoder")), device="cpu", dtype="float32")


def test_vllm_import_paths() -> None:
    import tidepool.config
    import tidepool.inputs
    import tidepool.outputs
    import tidepool.pooling_params

    assert tidepool.pooling_params.PoolingParams is PoolingParams
    assert tidepool.outputs.PoolingRequestOutput is tidepool.PoolingRequestOutput
    assert TokensPrompt(prompt_token_ids=[1]) == {"prompt_token_ids": [1]}
    assert TextPrompt(prompt="x") == {"prompt": "x"}
    assert isinstance(tidepool.config.PoolerConfig(), PoolerConfig)


def test_every_llm_argument_is_implemented_or_refused_by_name() -> None:
    """Never a bare TypeError for a vLLM argument: an EngineArgs field, or a known vLLM name
    refused with its reason (ValueError naming it) or accepted with a warning."""
    fields = set(EngineArgs.__dataclass_fields__)
    special = {"task", "gpu_memory_utilization"}
    for name in VLLM_LLM_ARGS:
        assert name in fields or name in VLLM_ARGS or name in special, name
    for name, arg in VLLM_ARGS.items():
        value = 7 if not arg.switch else True
        if value in arg.unset:  # a switch on by default in vLLM: on and off change nothing
            continue
        if arg.policy == "refuse":
            with pytest.raises(ValueError, match=name):
                engine_args_from_vllm({name: value})
        else:
            engine_args_from_vllm({name: value})  # a warning, no error
    with pytest.raises(TypeError, match="not_a_vllm_argument"):
        engine_args_from_vllm({"not_a_vllm_argument": 1})


def test_unset_vllm_arguments_change_nothing() -> None:
    """`LLM(**vars(args))` passes every flag at its default: None / 1 / False are accepted."""
    args = engine_args_from_vllm(
        {"tensor_parallel_size": 1, "enforce_eager": False, "revision": None, "seed": None}
    )
    assert args == EngineArgs()


def test_use_activation_and_its_deprecated_aliases(embedder: LLM) -> None:
    raw = embedder.embed(TEXTS[:1], pooling_params=PoolingParams(use_activation=False))
    norm = embedder.embed(TEXTS[:1])
    raw_v, norm_v = torch.tensor(raw[0].outputs.embedding), torch.tensor(norm[0].outputs.embedding)
    assert abs(float(norm_v.norm()) - 1.0) < 1e-5
    assert abs(float(raw_v.norm()) - 1.0) > 1e-3
    torch.testing.assert_close(F.normalize(raw_v, dim=0), norm_v, rtol=0, atol=1e-6)
    with pytest.warns(DeprecationWarning, match="use_activation"):
        alias = PoolingParams(normalize=False)
    assert alias.use_activation is False
    with pytest.raises(ValueError, match="contradicts"):
        PoolingParams(normalize=False, use_activation=True)


def test_vllm_removed_task_names_are_refused_with_vllms_reason() -> None:
    with pytest.raises(ValueError, match="token_embed or token_classify"):
        PoolingParams(task="encode")
    # Difference: vLLM folds "score" into "classify"; tidepool accepts both names.
    assert PoolingParams(task="score").task == "score"


def test_embed_token_ids_prompts_and_dimensions(embedder: LLM) -> None:
    tokenizer = embedder.get_tokenizer()
    ids = tokenizer(TEXTS[0])["input_ids"]
    by_text = embedder.embed(TEXTS[0])[0].outputs.embedding
    by_ids = embedder.embed([TokensPrompt(prompt_token_ids=ids)])[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(by_ids), torch.tensor(by_text), rtol=0, atol=1e-6)
    short = embedder.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=8))[0]
    assert len(short.outputs.embedding) == 8
    expected = F.normalize(torch.tensor(by_text[:8]), dim=0)  # renormalized after the cut
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), expected, atol=1e-5, rtol=0)


def test_outputs_carry_vllms_fields(embedder: LLM, cross_encoder: LLM) -> None:
    out = embedder.embed(TEXTS[0])[0]
    assert out.num_cached_tokens == 0 and out.finished  # an encoder has no prefix cache
    assert out.outputs.hidden_size == 32
    hf_config = cross_encoder.llm_engine.vllm_config.model_config.hf_config
    assert hf_config.num_labels == 1


def test_tokenization_kwargs(embedder: LLM) -> None:
    tokenizer = embedder.get_tokenizer()
    full = tokenizer(TEXTS[1])["input_ids"]
    cut = embedder.embed(TEXTS[1], tokenization_kwargs={"truncation": True, "max_length": 4})
    assert cut[0].prompt_token_ids == full[:3] + [full[-1]]  # special tokens included
    left = embedder.embed(
        TEXTS[1], tokenization_kwargs={"max_length": 4, "truncation_side": "left"}
    )
    assert left[0].prompt_token_ids == [full[0]] + full[-3:]
    bare = embedder.embed(TEXTS[1], tokenization_kwargs={"add_special_tokens": False})
    assert bare[0].prompt_token_ids == full[1:-1]
    with pytest.raises(ValueError, match="return_tensors"):
        embedder.embed(TEXTS[1], tokenization_kwargs={"return_tensors": "pt"})


def test_encode_with_each_task(embedder: LLM, cross_encoder: LLM) -> None:
    (tokens,) = embedder.encode(TEXTS[0], pooling_task="token_embed")
    assert tokens.outputs.data.shape == (len(tokens.prompt_token_ids), 32)
    (pooled,) = embedder.encode(TEXTS[0], pooling_task="embed")
    assert pooled.outputs.data.shape == (32,)
    (logits,) = cross_encoder.encode(TEXTS[0], pooling_task="classify")
    assert logits.outputs.data.shape == (1,)
    # Difference: tidepool's encode() without pooling_task runs the model's own task (vLLM 0.32
    # requires pooling_task); kept, more permissive.
    assert embedder.encode(TEXTS[0])[0].outputs.data.shape == (32,)


def test_score_1_to_n_and_n_to_n(cross_encoder: LLM, embedder: LLM) -> None:
    query, docs = "What is the capital of France?", TEXTS
    one_to_n = [o.outputs.score for o in cross_encoder.score(query, docs)]
    n_to_n = [o.outputs.score for o in cross_encoder.score([query] * 3, docs)]
    assert one_to_n == pytest.approx(n_to_n, abs=1e-6)
    raw = cross_encoder.score(query, docs, pooling_params=PoolingParams(use_activation=False))
    assert [1 / (1 + math.exp(-o.outputs.score)) for o in raw] == pytest.approx(one_to_n, abs=1e-6)
    cosine = embedder.score(query, docs[0])[0].outputs.score
    a, b = (torch.tensor(o.outputs.embedding) for o in embedder.embed([query, docs[0]]))
    assert cosine == pytest.approx(float(F.cosine_similarity(a, b, dim=0)), abs=1e-5)


def test_pooler_config_task_token_embed_scores_by_maxsim(tiny_model_path) -> None:
    llm = LLM(
        str(tiny_model_path("bert-mean")),
        device="cpu",
        dtype="float32",
        pooler_config={"task": "token_embed"},
    )
    query, doc = "capital of France", "Paris is the capital of France."
    score = llm.score(query, doc)[0].outputs.score
    q, d = (o.outputs.data for o in llm.encode([query, doc], pooling_task="token_embed"))
    assert score == pytest.approx(float((q @ d.T).max(dim=1).values.sum()), abs=1e-4)


def test_pooler_config_seq_pooling_type(tiny_model_path) -> None:
    path = str(tiny_model_path("bert-mean"))
    cls = LLM(path, device="cpu", dtype="float32", pooler_config={"pooling_type": "CLS"})
    tokens = cls.encode(TEXTS[0], pooling_task="token_embed")[0].outputs.data
    pooled = torch.tensor(cls.embed(TEXTS[0])[0].outputs.embedding)
    torch.testing.assert_close(pooled, tokens[0], atol=1e-5, rtol=0)  # CLS: the first token
    with pytest.raises(ValueError, match="STEP"):
        PoolerConfig(pooling_type="STEP")


def test_vllm_example_script_engine_args_cli(tiny_model_path) -> None:
    """vLLM's examples: FlexibleArgumentParser + EngineArgs.add_cli_args + LLM(**vars(args))."""
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=str(tiny_model_path("bert")), runner="pooling")
    args = parser.parse_args(["--device", "cpu", "--dtype", "float32", "--enforce-eager"])
    with warnings.catch_warnings():
        llm = LLM(**vars(args))
    assert len(llm.embed(TEXTS[0])[0].outputs.embedding) == 32
    args = parser.parse_args(["--no-enable-prefix-caching", "--max_model_len", "64"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.enable_prefix_caching is False and engine_args.max_model_len == 64
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs.from_cli_args(parser.parse_args(["-tp", "2"]))


def test_async_llm_engine_encode(tiny_model_path, embedder: LLM) -> None:
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=str(tiny_model_path("bert")), device="cpu", dtype="float32")
    )

    async def run() -> list:
        outs = [o async for o in engine.encode(TEXTS[0], PoolingParams(task="embed"), "req-1")]
        await engine.shutdown_async()
        return outs

    (out,) = asyncio.run(run())
    assert out.request_id == "req-1"
    expected = torch.tensor(embedder.embed(TEXTS[0])[0].outputs.embedding)
    torch.testing.assert_close(out.outputs.data, expected, atol=1e-6, rtol=0)


def test_score_chat_template_is_refused_with_the_alternative(cross_encoder: LLM) -> None:
    # Difference: vLLM renders an LLM reranker's pairs with score(chat_template=...); tidepool
    # takes the pair prompt at load (score_template=...).
    with pytest.raises(ValueError, match="score_template"):
        cross_encoder.score("q", "d", chat_template="{{ messages }}")
