"""Property-based tests of the request schemas (hypothesis, issue 18): arbitrary JSON in every
field of every route's body, Unicode that tokenizers choke on (lone surrogates, NUL, control
characters, combining marks, right-to-left marks), token-id lists, ~1 MB strings.

The invariant: a 2xx whose output fits the request, or a 4xx in OpenAI's error shape; never a
5xx (nor a 5xx error event inside a stream); and the next request on the same keep-alive
connection is answered. uvicorn runs in threads over tiny random models: an embedder (the pooling
routes, tokenize), a 3-label classifier (/classify) and a Llama (completions, chat).

Derandomized, without an example database, with bounded examples: the same requests on every
run, in a few seconds per route.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverlib import ThreadedServer, request_on, start_threaded_server

from tidepool.entrypoints.openai import protocol as p

NUM_EXAMPLES = 50
FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
SERVED_NAME = "fuzz"
ERROR_KEYS = {"message", "type", "param", "code"}
HIDDEN_SIZE = 32  # the tiny models' (tests/conftest.py, tests/tiny_decoders.py)

# ---------------------------------------------------------------------- strategies

SPECIAL_TEXTS = [
    "", " ", "\x00", "a\x00b", "\ud800", "abc \udfff", "\udc00\ud800 x", "e\u0301\u0301\u0301",
    "\u202eevil\u202c", "שלום עולם", "مرحبا", "\t\n\r\x0b\x0c\x85", "\x1b[31mred", "\ufeffbom",
    "\uffff\ufffe", "\U0010ffff", "🙂" * 5, "[CLS] [SEP] [PAD] <s> </s>", "word " * 300,
]  # fmt: skip
any_text = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),  # surrogates included
    st.sampled_from(SPECIAL_TEXTS),
)
good_text = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30
)
texts = st.one_of(good_text, any_text)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()  # NaN and Infinity too: json.dumps writes them and the server reads them
    | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=6,
)
token_ids = st.one_of(
    st.lists(st.integers(0, 2000), min_size=1, max_size=12),
    st.lists(st.integers(-(2**40), 2**40), max_size=6),
)
inputs = st.one_of(
    texts, st.lists(texts, min_size=1, max_size=4), token_ids, st.lists(token_ids, max_size=3)
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]) | any_text},
        optional={
            "content": texts
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)
            | json_values
        },
    ),
    max_size=3,
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values (so that 2xx answers happen), sometimes any JSON."""
    return st.one_of(valid, valid, valid, json_values)


def small_ints(low: int, high: int) -> st.SearchStrategy:
    return field(st.integers(low, high))


def body(required: dict[str, st.SearchStrategy], **optional: st.SearchStrategy):
    return st.fixed_dictionaries(required, optional=optional)


MODEL = field(st.sampled_from([SERVED_NAME, "", "gpt-4"]))
TRUNCATE = small_ints(-2, 200)
BOOL = field(st.booleans())
POOLING_FIELDS = dict(
    model=MODEL,
    encoding_format=field(st.sampled_from(["float", "base64", "xml"])),
    dimensions=small_ints(-1, 40),
    truncate_prompt_tokens=TRUNCATE,
    normalize=BOOL,
    user=field(texts),
)
SAMPLING_FIELDS = dict(
    model=MODEL,
    n=small_ints(-1, 3),
    temperature=field(st.floats(0, 3)),
    top_p=field(st.floats(0, 1)),
    top_k=small_ints(-2, 50),
    min_p=field(st.floats(0, 1)),
    seed=field(st.integers(-(2**65), 2**65)),
    stop=field(texts | st.lists(texts, max_size=3)),
    stop_token_ids=field(st.lists(st.integers(-5, 3000), max_size=3)),
    presence_penalty=field(st.floats(-3, 3)),
    frequency_penalty=field(st.floats(-3, 3)),
    repetition_penalty=field(st.floats(0, 3)),
    min_tokens=small_ints(-1, 8),
    ignore_eos=BOOL,
    include_stop_str_in_output=BOOL,
    skip_special_tokens=BOOL,
    truncate_prompt_tokens=small_ints(-2, 80),
    stream=BOOL,
    stream_options=field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    logit_bias=field(st.dictionaries(st.sampled_from(["1", "2"]), st.floats(-5, 5), max_size=1)),
)
CHAT_TEMPLATES = ["{{ messages[0]['content'] }}", "{% for %}", "{{ raise_exception('no') }}", ""]

RANDOM_BODIES: dict[str, st.SearchStrategy] = {
    "/v1/embeddings": body({"input": inputs}, **POOLING_FIELDS),
    "/pooling": body(
        {"input": inputs},
        task=field(st.sampled_from(["embed", "token_embed", "classify", "score", "bogus"])),
        activation=BOOL,
        **POOLING_FIELDS,
    ),
    "/classify": body(
        {"input": inputs}, model=MODEL, truncate_prompt_tokens=TRUNCATE, activation=BOOL
    ),
    "/score": body(
        {
            "text_1": field(texts | st.lists(texts, max_size=3)),
            "text_2": field(texts | st.lists(texts, max_size=3)),
        },
        model=MODEL,
        truncate_prompt_tokens=TRUNCATE,
    ),
    "/rerank": body(
        {
            "query": field(texts),
            "documents": field(
                st.lists(texts | st.fixed_dictionaries({"text": texts}), max_size=4)
            ),
        },
        top_n=small_ints(-1, 5),
        return_documents=BOOL,
        truncate_prompt_tokens=TRUNCATE,
    ),
    "/tokenize": body(
        {"prompt": field(texts)},
        messages=field(messages),
        add_special_tokens=BOOL,
        return_token_strs=BOOL,
        model=MODEL,
    ),
    "/detokenize": body({"tokens": field(token_ids)}, model=MODEL),
    "/v1/completions": body(
        {"prompt": inputs},
        max_tokens=small_ints(-1, 12),
        logprobs=small_ints(-1, 25),
        echo=BOOL,
        best_of=small_ints(0, 3),
        suffix=field(st.none() | texts),
        add_special_tokens=BOOL,
        **SAMPLING_FIELDS,
    ),
    "/v1/chat/completions": body(
        {"messages": field(messages)},
        max_tokens=small_ints(-1, 12),
        max_completion_tokens=small_ints(-1, 12),
        logprobs=BOOL,
        top_logprobs=small_ints(-1, 25),
        chat_template=field(st.sampled_from(CHAT_TEMPLATES) | texts),
        chat_template_kwargs=field(st.dictionaries(good_text, json_values, max_size=2)),
        add_generation_prompt=BOOL,
        continue_final_message=BOOL,
        response_format=field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
        tools=field(st.lists(json_values, max_size=1)),
        **SAMPLING_FIELDS,
    ),
}

# A valid body with one field (any field the route's schema has) set to a hostile value: finds
# what one bad field does, which a body of many random fields rarely shows (the first 422 wins).
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 1e308, -1e308, 0.5, float("nan"), float("inf")])
hostile = st.one_of(json_values, EDGE_INTS, EDGE_FLOATS, any_text, st.lists(EDGE_INTS, max_size=3))
good_inputs = st.one_of(
    good_text,
    st.lists(good_text, min_size=1, max_size=3),
    st.lists(st.integers(1, 400), min_size=1, max_size=8),
)
one_message = st.builds(lambda text: [{"role": "user", "content": text}], good_text)
VALID_BODIES: dict[str, st.SearchStrategy] = {
    "/v1/embeddings": st.fixed_dictionaries({"input": good_inputs}),
    "/pooling": st.fixed_dictionaries({"input": good_inputs}),
    "/classify": st.fixed_dictionaries({"input": good_inputs}),
    "/score": st.fixed_dictionaries(
        {"text_1": good_text, "text_2": st.lists(good_text, min_size=1, max_size=3)}
    ),
    "/rerank": st.fixed_dictionaries(
        {"query": good_text, "documents": st.lists(good_text, min_size=1, max_size=3)}
    ),
    "/tokenize": st.fixed_dictionaries({"prompt": good_text}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 400), max_size=8)}),
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": good_text, "max_tokens": st.integers(1, 4)}
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": one_message, "max_tokens": st.integers(1, 4)}
    ),
}
SCHEMAS = {
    "/v1/embeddings": p.EmbeddingRequest,
    "/pooling": p.PoolingRequest,
    "/classify": p.ClassificationRequest,
    "/score": p.ScoreRequest,
    "/rerank": p.RerankRequest,
    "/tokenize": p.TokenizeRequest,
    "/detokenize": p.DetokenizeRequest,
    "/v1/completions": p.CompletionRequest,
    "/v1/chat/completions": p.ChatCompletionRequest,
}


def one_field_hostile(route: str) -> st.SearchStrategy:
    names = st.sampled_from(sorted(SCHEMAS[route].model_fields))
    return st.tuples(VALID_BODIES[route], names, hostile).map(lambda t: {**t[0], t[1]: t[2]})


BODIES = {
    route: st.one_of(RANDOM_BODIES[route], one_field_hostile(route), VALID_BODIES[route])
    for route in RANDOM_BODIES
}

# ---------------------------------------------------------------------- what a 2xx must hold


def _num_inputs(value: Any) -> int:
    if isinstance(value, str) or all(isinstance(v, int) for v in value):
        return 1
    return len(value)


def _check_vectors(request: dict, data: list, key: str) -> None:
    assert [d["index"] for d in data] == list(range(_num_inputs(request["input"])))
    for item in data:
        vector = item[key]
        if isinstance(vector, str):  # base64 float32
            assert len(base64.b64decode(vector)) % 4 == 0
        elif request.get("task") != "token_embed":
            expected = request.get("dimensions") or HIDDEN_SIZE
            assert len(vector) == expected or request.get("task") in ("classify", "score")


def _check_embeddings(request: dict, answer: dict) -> None:
    _check_vectors(request, answer["data"], "embedding")


def _check_pooling(request: dict, answer: dict) -> None:
    _check_vectors(request, answer["data"], "data")


def _check_classify(request: dict, answer: dict) -> None:
    assert len(answer["data"]) == _num_inputs(request["input"])
    assert all(d["num_classes"] == 3 == len(d["probs"]) for d in answer["data"])


def _check_score(request: dict, answer: dict) -> None:
    sizes = [1 if isinstance(t, str) else len(t) for t in (request["text_1"], request["text_2"])]
    assert len(answer["data"]) == max(sizes)


def _check_rerank(request: dict, answer: dict) -> None:
    indices = [r["index"] for r in answer["results"]]
    num_docs = len(request["documents"])
    assert len(set(indices)) == len(indices) == min(request.get("top_n") or num_docs, num_docs)


def _check_tokenize(request: dict, answer: dict) -> None:
    assert answer["count"] == len(answer["tokens"])


def _check_detokenize(request: dict, answer: dict) -> None:
    assert isinstance(answer["prompt"], str)


def _check_choices(num_choices: int) -> Callable[[dict, Any], None]:
    def check(request: dict, answer: Any) -> None:
        if isinstance(answer, list):  # stream events
            assert answer[-1] == "[DONE]"
            for event in answer[:-1]:
                assert event.get("error", {}).get("code", 400) < 500, event
            return
        assert len(answer["choices"]) == num_choices

    return check


def _check_completions(request: dict, answer: Any) -> None:
    _check_choices(_num_inputs(request["prompt"]) * request.get("n", 1))(request, answer)


def _check_chat(request: dict, answer: Any) -> None:
    _check_choices(request.get("n", 1))(request, answer)


CHECKS = {
    "/v1/embeddings": _check_embeddings,
    "/pooling": _check_pooling,
    "/classify": _check_classify,
    "/score": _check_score,
    "/rerank": _check_rerank,
    "/tokenize": _check_tokenize,
    "/detokenize": _check_detokenize,
    "/v1/completions": _check_completions,
    "/v1/chat/completions": _check_chat,
}

# ---------------------------------------------------------------------- servers


def _serve(path, **engine_args) -> ThreadedServer:
    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import ServerArgs, build_app

    engine = AsyncEngine.from_args(str(path), device="cpu", dtype="float32", **engine_args)
    args = ServerArgs(served_model_name=[SERVED_NAME], max_inputs_per_request=16)
    return start_threaded_server(build_app(engine, args))


@pytest.fixture(scope="module")
def servers(tiny_model_path, tiny_decoder_path) -> Iterator[dict[str, ThreadedServer]]:
    embedder = _serve(tiny_model_path("bert"))
    classifier = _serve(tiny_model_path("roberta-classifier"))
    generator = _serve(tiny_decoder_path("llama"), max_model_len=64)
    by_route = {route: embedder for route in BODIES}
    by_route["/classify"] = classifier
    by_route["/v1/completions"] = by_route["/v1/chat/completions"] = generator
    yield by_route
    for server in (embedder, classifier, generator):
        server.stop()


def _sse_events(payload: bytes) -> list:
    events = []
    for block in payload.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_invariant(conn, route: str, request: dict) -> None:
    raw = json.dumps(request).encode()  # ensure_ascii: a lone surrogate travels as \\udXXX
    answer = request_on(conn, "POST", route, raw, {"Content-Type": "application/json"})
    assert answer.status < 500, (answer.status, answer.body[:500])
    if answer.status < 300:
        is_stream = answer.headers.get("content-type", "").startswith("text/event-stream")
        CHECKS[route](request, _sse_events(answer.body) if is_stream else answer.json())
    else:
        assert 400 <= answer.status < 500, answer.status
        error = answer.json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == answer.status, error
    assert request_on(conn, "GET", "/health").status == 200  # same connection, still served


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("route", list(BODIES))
def test_any_body_answers_2xx_or_4xx_and_keeps_the_connection(servers, route: str) -> None:
    conn = servers[route].connection()

    @FUZZ
    @given(request=BODIES[route])
    def run(request: dict) -> None:
        assert_invariant(conn, route, request)

    try:
        run()
    finally:
        conn.close()


MEGABYTE_TEXT = "tide pool " * 100_000  # 1 MB, ~200k tokens
BIG_BODIES = {
    "/v1/embeddings": {"input": ["ok", MEGABYTE_TEXT]},
    "/rerank": {"query": MEGABYTE_TEXT, "documents": ["ok"]},
    "/tokenize": {"prompt": MEGABYTE_TEXT},
    "/v1/completions": {"prompt": MEGABYTE_TEXT, "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": MEGABYTE_TEXT}]},
}


@pytest.mark.parametrize("route", list(BIG_BODIES))
def test_megabyte_strings(servers, route: str) -> None:
    conn = servers[route].connection()
    try:
        assert_invariant(conn, route, BIG_BODIES[route])
    finally:
        conn.close()


# Every field of every schema set, in turn, to each of these in an otherwise valid body.
EDGE_VALUES = [
    None, True, "8", 8.0, -1, 0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, float("nan"),
    float("inf"), "", "\ud800", [], [2**64], {}, {"text": [None]},
]  # fmt: skip
FIXED_BODIES = {
    "/v1/embeddings": {"input": "a tide pool"},
    "/pooling": {"input": ["a tide pool", "a rock"]},
    "/classify": {"input": "a tide pool"},
    "/score": {"text_1": "a tide pool", "text_2": ["a rock", "the sea"]},
    "/rerank": {"query": "a tide pool", "documents": ["a rock", "the sea"]},
    "/tokenize": {"prompt": "a tide pool"},
    "/detokenize": {"tokens": [5, 6, 7]},
    "/v1/completions": {"prompt": "a tide pool", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


@pytest.mark.parametrize("route", list(FIXED_BODIES))
def test_each_field_with_each_edge_value(servers, route: str) -> None:
    conn = servers[route].connection()
    try:
        for name in sorted(SCHEMAS[route].model_fields):
            for value in EDGE_VALUES:
                assert_invariant(conn, route, {**FIXED_BODIES[route], name: value})
    finally:
        conn.close()


# Issue 26: a body nested ~990-1,024 deep in a content field was a 500 (RecursionError) on the
# fast path. Every content field of every route, chat messages on the generating model
# included, at depths around every parser's limit: a 400 naming the depth (or, within the
# limit, whatever the field's checks say), never a 5xx, the connection still served.
DEEP_FIELDS = {
    "/v1/embeddings": ["input"], "/pooling": ["input"], "/classify": ["input"],
    "/score": ["text_1", "text_2"], "/rerank": ["query", "documents"],
    "/tokenize": ["prompt", "messages"], "/detokenize": ["tokens"],
    "/v1/completions": ["prompt"], "/v1/chat/completions": ["messages"],
}  # fmt: skip
DEEP_SHAPES = {
    "lists": lambda depth: "[" * depth + '"a"' + "]" * depth,
    "objects": lambda depth: '{"role": "user", "content": ' * depth + '"a"' + "}" * depth,
    "message parts": lambda depth: (
        '[{"role": "user", "content": '
        + '[{"type": "text", "text": ' * depth
        + '"a"'
        + "}]" * depth
        + "}]"
    ),
}


@pytest.mark.parametrize("route", list(DEEP_FIELDS))
def test_deep_bodies_never_answer_5xx(servers, route: str) -> None:
    conn = servers[route].connection()
    try:
        for name in DEEP_FIELDS[route]:
            for shape, nest in DEEP_SHAPES.items():
                for depth in (30, 63, 500, 989, 990, 1000, 1023, 1024, 1025):
                    base = json.dumps({k: v for k, v in FIXED_BODIES[route].items() if k != name})
                    raw = (base[:-1] + f', "{name}": {nest(depth)}}}').encode()
                    answer = request_on(
                        conn, "POST", route, raw, {"Content-Type": "application/json"}
                    )
                    assert answer.status < 500, (route, name, shape, depth, answer.body[:300])
                    if depth >= 500:
                        assert answer.status == 400
                        assert (
                            "levels deep; this server reads at most 64"
                            in answer.json()["error"]["message"]
                        )
                    assert request_on(conn, "GET", "/health").status == 200
    finally:
        conn.close()
