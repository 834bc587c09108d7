"""vLLM 0.32's generation surface on a tiny random Llama: `num_cached_tokens` (offline and the
server's usage.prompt_tokens_details), AsyncLLMEngine.generate streaming per
SamplingParams.output_kind with abort, and the --trust-request-chat-template rule."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tidepool import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from tidepool.sampling_params import RequestOutputKind

BLOCK_SIZE = 16
SHARED = (
    "Paged attention stores keys and values in fixed-size blocks. Prefix caching computes a "
    "shared instruction once and reuses its blocks. "
) * 2
MESSAGES = [{"role": "user", "content": "Hello there"}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _greedy(max_tokens: int = 4, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


@pytest.fixture(scope="module")
def model_path(tiny_decoder_path) -> Path:
    return tiny_decoder_path("llama")


# ---------------------------------------------------------------------- num_cached_tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_num_cached_tokens_is_the_block_aligned_prefix_hit(model_path, prefix_caching) -> None:
    llm = LLM(str(model_path), device="cpu", dtype="float32", enable_prefix_caching=prefix_caching)
    [first] = llm.generate([SHARED + "The quick brown fox"], _greedy(), use_tqdm=False)
    [second] = llm.generate([SHARED + "Hello world"], _greedy(), use_tqdm=False)
    assert first.num_cached_tokens == 0  # nothing cached yet
    common = _common_prefix(first.prompt_token_ids, second.prompt_token_ids)
    assert common >= 2 * BLOCK_SIZE  # the test's premise: at least two shared full blocks
    expected = (common // BLOCK_SIZE) * BLOCK_SIZE if prefix_caching else 0
    assert second.num_cached_tokens == expected


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, json=body)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine(model_path):
    from tidepool.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_args(str(model_path), device="cpu", dtype="float32")
    engine.start()
    yield engine
    asyncio.run(engine.shutdown())


def _app(engine, **server_args):
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    return build_app(engine, ServerArgs(**server_args))


def test_usage_reports_cached_tokens_with_the_flag(engine) -> None:
    app = _app(engine, enable_prompt_tokens_details=True)
    body = {"prompt": SHARED + "one", "max_tokens": 2, "temperature": 0}
    first = _post(app, "/v1/completions", body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}  # vLLM reports a 0 too
    again = _post(app, "/v1/completions", {**body, "prompt": SHARED + "two"}).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < again["prompt_tokens"]
    chat = {"messages": [{"role": "user", "content": SHARED}], "max_tokens": 2}
    _post(app, "/v1/chat/completions", chat)
    usage = _post(app, "/v1/chat/completions", chat).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] % BLOCK_SIZE == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    streamed = _post(
        app,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    ).text
    assert '"prompt_tokens_details":{"cached_tokens":' in streamed
    # Without the flag (vLLM's default) usage has no details, even on a hit.
    plain = _post(_app(engine), "/v1/completions", body).json()["usage"]
    assert plain["prompt_tokens_details"] is None


# ---------------------------------------------------------------------- chat template trust


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"max_tokens": 2, "chat_template": TEMPLATE}),
        ("/v1/chat/completions", {"max_tokens": 2, "chat_template_kwargs": {"chat_template": TEMPLATE}}),
        ("/tokenize", {"chat_template": TEMPLATE}),
    ],
)  # fmt: skip
def test_request_chat_template_needs_the_flag(engine, path: str, extra: dict) -> None:
    body = {"messages": MESSAGES, **extra}
    refused = _post(_app(engine), path, body)
    assert refused.status_code == 400
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    trusted = _post(_app(engine, trust_request_chat_template=True), path, body)
    assert trusted.status_code == 200, trusted.text
    if path == "/tokenize":  # the request's template rendered the prompt
        tokenizer = engine.tokenizer
        expected = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
        assert trusted.json()["tokens"] == expected
    # The model's own template needs no flag.
    assert _post(_app(engine), path, {"messages": MESSAGES, "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------------- AsyncLLMEngine.generate


@pytest.fixture(scope="module")
def async_llm(model_path):
    args = AsyncEngineArgs(model=str(model_path), device="cpu", dtype="float32")
    return AsyncLLMEngine.from_engine_args(args)


def _collect(engine: AsyncLLMEngine, prompt: str, params: SamplingParams, rid: str) -> list:
    async def run() -> list:
        return [out async for out in engine.generate(prompt, params, request_id=rid)]

    return asyncio.run(run())


def test_async_generate_streams_per_output_kind(async_llm, model_path) -> None:
    offline = LLM(str(model_path), device="cpu", dtype="float32")
    [final] = offline.generate(["The quick brown fox"], _greedy(16), use_tqdm=False)
    expected = final.outputs[0]
    cumulative = _collect(async_llm, "The quick brown fox", _greedy(16), "c")
    assert len(cumulative) > 1 and all(o.request_id == "c" for o in cumulative)
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == expected.text
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    delta_params = _greedy(16, output_kind=RequestOutputKind.DELTA)
    deltas = _collect(async_llm, "The quick brown fox", delta_params, "d")
    assert len(deltas) > 1 and deltas[-1].finished
    assert "".join(o.outputs[0].text for o in deltas) == expected.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == expected.token_ids
    final_only = _greedy(16, output_kind=RequestOutputKind.FINAL_ONLY)
    [only] = _collect(async_llm, "The quick brown fox", final_only, "f")
    assert only.finished and only.outputs[0].token_ids == expected.token_ids
    # n = 2: every output carries both completions (vLLM's parallel sampling)
    [both] = _collect(
        async_llm, "Hello", _greedy(4, n=2, output_kind=RequestOutputKind.FINAL_ONLY), "n"
    )
    assert [c.index for c in both.outputs] == [0, 1]


def test_async_generate_abort_ends_the_stream(async_llm) -> None:
    async def run() -> list:
        got: list = []

        async def consume() -> None:
            async for out in async_llm.generate("Hello", _greedy(400), request_id="a"):
                got.append(out)

        task = asyncio.ensure_future(consume())
        while len(got) < 2:
            await asyncio.sleep(0.005)
        await async_llm.abort("a")
        await asyncio.wait_for(task, 30)
        return got

    got = asyncio.run(run())
    last = got[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 400
    deadline = time.monotonic() + 30
    while async_llm.engine._engine.num_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.01)  # the abort reaches the engine thread through its inbox
    assert async_llm.engine._engine.num_unfinished_requests == 0


def test_output_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
