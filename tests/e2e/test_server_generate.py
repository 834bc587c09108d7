"""`tidepool serve` on a tiny random Llama: /v1/completions and /v1/chat/completions, called with the
official `openai` client and with httpx, JSON and server-sent events.

Greedy results must equal the offline `LLM.generate` / `LLM.chat` (same model, float32, CPU), for
one request or 40 concurrent ones sharing engine steps; streamed deltas must concatenate to the
non-streamed text. Errors keep their HTTP status and the server keeps serving; a client that goes
away mid-stream aborts its request in the engine. An in-process app checks what the subprocess
cannot (a failing engine step inside a stream, a tokenizer without a chat template) and the same
checkpoint with `--runner pooling` (an embedding model, which refuses generation).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverlib import ServerProcess, metric_value, start_server

from tidepool import LLM, SamplingParams

SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 256
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital",
    "Hello world! Streaming",
    "Numbers 0 1 2 3",
]
MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 16}


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_path(tiny_decoder_path) -> Path:
    return tiny_decoder_path("llama")


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("generate_server") / "server.log"
    args = [
        str(model_path), "--served-model-name", SERVED_NAME, "--dtype", "float32",
        "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--runner", "auto",
    ]  # fmt: skip
    srv = start_server(args, log)
    yield srv
    assert srv.stop_gracefully(), srv.log()


@pytest.fixture(scope="module")
def offline(tiny_decoder_llm) -> LLM:
    return tiny_decoder_llm("llama")


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def offline_texts(llm: LLM, prompts: list, **params) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def sse_events(response: httpx.Response) -> list:
    """The JSON events of a text/event-stream, then the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metrics(http: httpx.Client) -> str:
    return http.get("/metrics").text


def wait_until_idle(http: httpx.Client, timeout_s: float = 20.0) -> str:
    """/metrics once the engine holds no request (unfinished or running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(http)
        busy = metric_value(text, "tidepool:num_requests_unfinished") + metric_value(
            text, "tidepool:num_requests_running"
        )
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


# ---------------------------------------------------------------------- completions


def test_completions_equal_offline_generate(client, offline: LLM) -> None:
    expected = offline_texts(offline, PROMPTS, **GREEDY)
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, **GREEDY)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.model == SERVED_NAME
    assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in response.choices] == expected
    outs = offline.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    assert [c.finish_reason for c in response.choices] == [o.outputs[0].finish_reason for o in outs]
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    num_completion_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert response.usage.prompt_tokens == num_prompt_tokens
    assert response.usage.completion_tokens == num_completion_tokens
    assert response.usage.total_tokens == num_prompt_tokens + num_completion_tokens
    # One prompt alone gives the same text as in the batch.
    single = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], **GREEDY)
    assert single.choices[0].text == expected[1]


def test_completions_token_id_prompts(client, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    expected = offline_texts(offline, PROMPTS[:2], **GREEDY)
    one = client.completions.create(model=SERVED_NAME, prompt=ids[0], **GREEDY)
    assert one.choices[0].text == expected[0]
    both = client.completions.create(model=SERVED_NAME, prompt=ids, **GREEDY)
    assert [c.text for c in both.choices] == expected


def test_completions_stream_concatenates_to_the_text(client, offline: LLM) -> None:
    expected = offline_texts(offline, PROMPTS, **GREEDY)
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPTS,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    texts = [""] * len(PROMPTS)
    finish_reasons: list = [None] * len(PROMPTS)
    chunks = list(stream)
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and chunk.usage is None
        for choice in chunk.choices:
            assert finish_reasons[choice.index] is None  # nothing after the final chunk
            texts[choice.index] += choice.text
            finish_reasons[choice.index] = choice.finish_reason
    assert texts == expected
    assert all(reason in ("stop", "length") for reason in finish_reasons)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    plain = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, **GREEDY)
    assert usage_chunk.usage.model_dump() == plain.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_completions_raw_sse_format(http: httpx.Client) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


def _stop_string(text: str) -> tuple[str, int]:
    """An ASCII two-character stop string inside `text`, and where it first starts."""
    for start in range(2, len(text) - 2):
        candidate = text[start : start + 2]
        if candidate.isascii() and candidate.isprintable() and text.find(candidate) == start:
            return candidate, start
    raise AssertionError(f"no ASCII stop string in {text!r}")


def test_stop_strings(client, http: httpx.Client, offline: LLM) -> None:
    full = offline_texts(offline, [PROMPTS[2]], **GREEDY)[0]
    stop, cut = _stop_string(full)
    expected = offline_texts(offline, [PROMPTS[2]], stop=[stop], **GREEDY)[0]
    assert expected == full[:cut]
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], stop=stop, **GREEDY)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    # Streamed: the deltas never show a stop string's start that is later cut.
    body = {"model": SERVED_NAME, "prompt": PROMPTS[2], "stop": [stop], "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as streamed:
        events = sse_events(streamed)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert events[-2]["choices"][0]["stop_reason"] == stop
    # include_stop_str_in_output keeps it.
    kept = http.post(
        "/v1/completions",
        json={**body, "stream": False, "include_stop_str_in_output": True},
    ).json()
    assert kept["choices"][0]["text"] == full[: cut + len(stop)]


def test_logprobs_and_echo(client, offline: LLM) -> None:
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    logprobs = response.choices[0].logprobs
    num_tokens = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == num_tokens
    # Greedy: the sampled token is the likeliest one.
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert token_logprob <= 0 and len(top) >= 1
        assert token_logprob >= max(top.values()) - 1e-5
    offline_out = offline.generate(
        PROMPTS[0], SamplingParams(logprobs=2, **GREEDY), use_tqdm=False
    )[0].outputs[0]
    assert logprobs.token_logprobs == pytest.approx(
        [
            pos[t].logprob
            for t, pos in zip(offline_out.token_ids, offline_out.logprobs, strict=True)
        ],
        abs=1e-4,
    )
    echoed = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPTS[0] + response.choices[0].text


def test_n_and_seed_match_offline(client, offline: LLM) -> None:
    params = {"temperature": 1.0, "max_tokens": 12, "seed": 1234}
    outs = offline.generate(PROMPTS[:2], SamplingParams(n=3, **params), use_tqdm=False)
    expected = [c.text for o in outs for c in o.outputs]
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[:2], n=3, **params)
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == expected
    assert len(set(expected[:3])) > 1  # sampled, not greedy: the seeds differ per completion


# ---------------------------------------------------------------------- chat


def test_chat_equals_offline_chat(client, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False)[0]
    response = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0.0, max_completion_tokens=16
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    # max_tokens (deprecated by OpenAI) still works.
    old_style = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0.0, max_tokens=16
    )
    assert old_style.choices[0].message.content == expected.outputs[0].text


def test_chat_stream(client, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    chunks = list(
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=MESSAGES,
            temperature=0.0,
            max_completion_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    content_chunks = [c for c in chunks[1:] if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected.text
    assert content_chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected.token_ids
    )


def test_chat_text_parts_and_logprobs(client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is a KV cache?"}]}]
    plain = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0.0, max_tokens=8
    )
    with_parts = client.chat.completions.create(
        model=SERVED_NAME, messages=parts, temperature=0.0, max_tokens=8, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    assert with_parts.choices[0].message.content == plain.choices[0].message.content
    content = with_parts.choices[0].logprobs.content
    assert len(content) == with_parts.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert all(item.logprob == pytest.approx(item.top_logprobs[0].logprob) for item in content)


def test_tokenize_messages(http: httpx.Client, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    response = http.post("/tokenize", json={"messages": MESSAGES})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------- concurrency


def test_concurrent_clients_share_steps_and_equal_offline(server, http, offline: LLM) -> None:
    openai = pytest.importorskip("openai")
    num_requests = 40
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(num_requests)]
    max_tokens = [8 + i % 12 for i in range(num_requests)]
    outs = offline.generate(
        prompts,
        [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens],
        use_tqdm=False,
    )
    expected = [o.outputs[0].text for o in outs]
    steps_before = metric_value(metrics(http), "tidepool:engine_steps_total")

    async def one(client, i: int) -> str:
        kwargs = {"model": SERVED_NAME, "temperature": 0.0, "max_tokens": max_tokens[i]}
        if i % 3 == 0:  # a third streamed, a third chat-free completions, a third token ids
            stream = await client.completions.create(prompt=prompts[i], stream=True, **kwargs)
            return "".join([c.choices[0].text async for c in stream])
        if i % 3 == 1:
            response = await client.completions.create(prompt=prompts[i], **kwargs)
            return response.choices[0].text
        ids = offline.get_tokenizer()(prompts[i])["input_ids"]
        response = await client.completions.create(prompt=ids, **kwargs)
        return response.choices[0].text

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(num_requests)))

    texts = asyncio.run(run())
    assert texts == expected
    num_steps = metric_value(metrics(http), "tidepool:engine_steps_total") - steps_before
    # Alone, the requests would take sum(max_tokens) = 560 steps; sharing makes it a fraction.
    assert num_steps < sum(max_tokens) / 3, num_steps


# ---------------------------------------------------------------------- errors

BAD_REQUESTS = [
    # (id, path, body, status, words the message must contain)
    ("too-long", "/v1/completions", {"prompt": "The quick", "max_tokens": 300}, 400,
     ["maximum context length is 256", "300 in the completion"]),
    ("prompt-too-long", "/v1/completions", {"prompt": [5] * 300}, 400, ["300", "256"]),
    ("chat-too-long", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 260}, 400,
     ["256", "in the messages"]),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, ["empty string"]),
    ("empty-list", "/v1/completions", {"prompt": []}, 400, ["empty list"]),
    ("vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, ["outside the vocabulary"]),
    ("n-zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, ["n must be >= 1"]),
    ("temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, ["temperature"]),
    ("top-p", "/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, ["top_p"]),
    ("max-tokens-0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
    ("logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, ["at most 20"]),
    ("empty-stop", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, ["stop"]),
    ("echo-logprobs", "/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400,
     ["echo"]),
    ("no-messages", "/v1/chat/completions", {"messages": []}, 400, ["empty list"]),
    ("no-role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, ["role"]),
    ("image", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     ["image_url"]),
    ("top-logprobs-alone", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400,
     ["logprobs"]),
    ("tools", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400,
     ["tools"]),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, ["gpt-4"]),
    ("unknown-model-chat", "/v1/chat/completions", {"model": "x", "messages": MESSAGES}, 404,
     ["`x`"]),
    ("no-prompt", "/v1/completions", {"max_tokens": 3}, 422, ["prompt"]),
    ("bad-temperature", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 422,
     ["temperature"]),
    ("bad-n", "/v1/completions", {"prompt": "hi", "n": "many"}, 422, ["n"]),
    ("bad-stop", "/v1/completions", {"prompt": "hi", "stop": 5}, 422, ["stop"]),
    ("messages-string", "/v1/chat/completions", {"messages": "hi"}, 422, ["messages"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests(http: httpx.Client, path: str, body: dict, status: int, words) -> None:
    for stream in (False, True):  # a refused stream answers JSON with the status too
        response = http.post(path, json={**body, "stream": stream})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == status
        for word in words:
            assert word in error["message"], error["message"]


def test_serves_after_errors(client) -> None:
    response = client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------- disconnects


def test_disconnect_mid_stream_aborts_in_engine(server, http: httpx.Client) -> None:
    before = metrics(http)
    body = {
        "model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True,
        "temperature": 0.0, "stream": True,
    }  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            num_events = sum(1 for line in (next(lines) for _ in range(6)) if line)
        assert num_events >= 2  # the connection closes here, mid-stream
    after = wait_until_idle(http)
    assert metric_value(after, "tidepool:num_requests_unfinished") == 0
    assert metric_value(after, "tidepool:num_requests_running") == 0
    aborted = metric_value(after, "tidepool:requests_aborted_total")
    assert aborted == metric_value(before, "tidepool:requests_aborted_total") + 1
    route = {"route": "/v1/completions"}
    generated = metric_value(after, "tidepool:generation_tokens_total", route) - metric_value(
        before, "tidepool:generation_tokens_total", route
    )
    assert 2 <= generated < 240  # cut short, and counted


def test_disconnect_non_streamed_aborts_in_engine(server, http: httpx.Client) -> None:
    aborted_before = metric_value(metrics(http), "tidepool:requests_aborted_total")
    prompts = PROMPTS * 4
    body = {
        "model": SERVED_NAME, "prompt": prompts, "max_tokens": 240, "ignore_eos": True,
        "temperature": 0.0,
    }  # fmt: skip
    # The client gives up after what the same request with 24 steps took (the faster of two), so
    # the 240-step one, the same fixed part plus ten times the decoding, cannot be done by then. A
    # fixed timeout broke once the decoder got faster, and a third of the 240-step estimate broke
    # on a fast CPU where the fixed part (HTTP, prefill of 16 prompts) outweighs 24 steps.
    short = []
    for _ in range(2):
        start = time.perf_counter()
        httpx.post(f"{server.url}/v1/completions", json=dict(body, max_tokens=24), timeout=30)
        short.append(time.perf_counter() - start)
    timeout = min(short)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout)
    after = wait_until_idle(http)
    assert metric_value(after, "tidepool:num_requests_running") == 0
    assert metric_value(after, "tidepool:requests_aborted_total") == aborted_before + len(prompts)


# ---------------------------------------------------------------------- metrics, models


def test_generation_metrics_and_models(http: httpx.Client) -> None:
    text = metrics(http)
    for route in ("/v1/completions", "/v1/chat/completions"):
        labels = {"route": route}
        assert metric_value(text, "tidepool:generation_tokens_total", labels) > 0
        assert metric_value(text, "tidepool:prompt_tokens_total", labels) > 0
        assert metric_value(text, "tidepool:http_request_duration_seconds_count", labels) > 0
        assert metric_value(text, "tidepool:time_to_first_token_seconds_count", labels) > 0
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


# ---------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def in_process(model_path: Path):
    """An app over an engine in this process (no lifespan: the engine is started here)."""
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    engine = AsyncEngine.from_args(str(model_path), device="cpu", dtype="float32")
    engine.start()
    yield engine, build_app(engine)
    asyncio.run(engine.shutdown())


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, json=body)

    return asyncio.run(run())


def test_failed_step_inside_a_stream_is_an_error_event(in_process, monkeypatch) -> None:
    engine, app = in_process
    runner = engine._core.model_runner
    execute = runner.execute
    num_calls = 0

    def failing_execute(sched_out):
        nonlocal num_calls
        num_calls += 1
        if num_calls == 4:
            raise RuntimeError("injected failure")
        return execute(sched_out)

    monkeypatch.setattr(runner, "execute", failing_execute)
    body = {"prompt": PROMPTS[0], "max_tokens": 20, "ignore_eos": True, "stream": True}
    response = _post(app, "/v1/completions", body)
    assert response.status_code == 200
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "injected failure" in error["message"]
    assert len(events) >= 3  # text came before the failure
    monkeypatch.setattr(runner, "execute", execute)
    assert _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_chat_template_missing_or_given(in_process, monkeypatch) -> None:
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    engine, _ = in_process
    # A request's own template needs --trust-request-chat-template (vLLM's rule).
    app = build_app(engine, ServerArgs(trust_request_chat_template=True))
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    refused = _post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    assert refused.status_code == 400
    assert "no chat template" in refused.json()["error"]["message"]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    given = _post(
        app,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "chat_template": template, "temperature": 0},
    )
    assert given.status_code == 200, given.text
    broken = _post(
        app, "/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{% for %}"}
    )
    assert broken.status_code == 400 and "chat template" in broken.json()["error"]["message"]


def test_pooling_runner_refuses_generation(model_path: Path) -> None:
    """`tidepool serve MODEL --runner pooling` on the same checkpoint: an embedding model, whose
    generation routes answer 400 while its embeddings work."""
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.cli import build_parser
    from tidepool.entrypoints.cli_args import _engine_kwargs
    from tidepool.entrypoints.openai.server import build_app

    args = build_parser().parse_args(["serve", str(model_path), "--runner", "pooling"])
    kwargs = {**_engine_kwargs(args), "device": "cpu", "dtype": "float32"}
    assert kwargs["runner"] == "pooling"
    engine = AsyncEngine.from_args(str(model_path), **kwargs)
    engine.start()
    try:
        app = build_app(engine)
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": MESSAGES}),
        ):
            response = _post(app, path, body)
            assert response.status_code == 400
            assert "does not support the" in response.json()["error"]["message"]
        embedded = _post(app, "/v1/embeddings", {"input": "hi"})
        assert embedded.status_code == 200
        assert len(embedded.json()["data"][0]["embedding"]) == 64
    finally:
        asyncio.run(engine.shutdown())
