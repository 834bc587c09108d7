"""The content fields of a request, checked: what the schemas leave loose on purpose (`input`,
`text_1`, `documents`, `messages`...) so that a mistake answers 400 with its exact place
("input[3] is an empty string", "documents[1] is not valid Unicode ...").

Every text is checked for what the tokenizer cannot take (a lone surrogate: valid JSON, `"\\ud800"`,
but no UTF-8) before it reaches any tokenizer, whichever route brought it.
"""

from __future__ import annotations

from typing import Any

from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.outputs import BatchInputError
from tidepool.params import SamplingParams

MAX_LOGPROBS = 20
"""Most alternatives per position a request may ask for (vLLM's default --max-logprobs)."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds torch.Generator.manual_seed takes."""
INPUT_TYPES_HINT = "a string, a list of strings, a list of token ids or a list of token-id lists"
_MAX_ERRORS_SHOWN = 3


def check_text(text: str, where: str, param: str) -> str:
    """`text` if UTF-8 can encode it; else 400 naming `where` and the offending character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        raise ApiError(
            400,
            f"{where} is not valid Unicode: a lone surrogate (\\u{ord(char):04x}) at character "
            f"{e.start}; a JSON \\u escape of a surrogate must be followed by its pair",
            param,
        ) from e
    return text


def check_strings(value: Any, where: str, param: str) -> None:
    """`check_text` on every string inside `value` (keys too): chat messages, template kwargs."""
    if isinstance(value, str):
        check_text(value, where, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(str(key), f"{where} (a key)", param)
            check_strings(item, f"{where}.{key}", param)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{where}[{i}]", param)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class BuiltPrompts(list):
    """Prompts the server built itself (the prompt dicts of messages with image parts,
    openai/media_inputs.py): parse_prompts takes them as they are."""


def parse_prompts(value: Any, param: str = "input") -> list[Any]:
    """`input` as OpenAI accepts it → prompts for InputProcessor (strings or token-id dicts).

    "a" → ["a"];  ["a", "b"] → ["a", "b"];  [1, 2] → [{ids: [1, 2]}];  [[1], [2]] → two prompts.
    """
    if isinstance(value, BuiltPrompts):
        return list(value)
    if isinstance(value, str):
        return [check_text(value, param, param)]
    if not isinstance(value, list):
        raise ApiError(400, f"{param} must be {INPUT_TYPES_HINT}, got {type_name(value)}", param)
    if not value:
        raise ApiError(400, f"{param} is an empty list: give at least one input", param)
    if all(_is_token_id(v) for v in value):
        return [{"prompt_token_ids": value}]
    if _is_token_id(value[0]):  # a list of token ids with something else in it: name that
        i = next(i for i, v in enumerate(value) if not _is_token_id(v))
        raise ApiError(
            400,
            f"{param}[{i}] is {_value_kind(value[i])}: a list of token ids holds integers only "
            f"({param} must be {INPUT_TYPES_HINT})",
            param,
        )
    prompts: list[Any] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(check_text(item, f"{param}[{i}]", param))
        elif isinstance(item, list):
            prompts.append({"prompt_token_ids": item})
        else:
            raise ApiError(
                400,
                f"{param}[{i}] has type {type_name(item)}; expected a string or a list of token "
                f"ids ({param} must be {INPUT_TYPES_HINT})",
                param,
            )
    return prompts


def parse_texts(value: Any, param: str, allow_single: bool = True) -> list[str]:
    """A string or a non-empty list of strings (score and rerank inputs)."""
    if isinstance(value, str) and allow_single:
        return [check_text(value, param, param)]
    if isinstance(value, dict) and "text" in value and allow_single:
        return parse_texts(value["text"], param)
    if not isinstance(value, list):
        raise ApiError(
            400, f"{param} must be a string or a list of strings, got {type_name(value)}", param
        )
    if not value:
        raise ApiError(400, f"{param} is an empty list", param)
    texts = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]  # Cohere v1 / Jina document objects
        if not isinstance(item, str):
            raise ApiError(
                400, f"{param}[{i}] has type {type_name(item)}; expected a string", param
            )
        if not item:
            raise ApiError(400, f"{param}[{i}] is an empty string", param)
        texts.append(check_text(item, f"{param}[{i}]", param))
    return texts


def check_request_chat_template(
    chat_template: Any, chat_template_kwargs: dict[str, Any] | None, trusted: bool
) -> None:
    """vLLM's rule: a request brings its own template (`chat_template`, or one inside
    `chat_template_kwargs`) only on a server started with --trust-request-chat-template."""
    in_kwargs = isinstance(chat_template_kwargs, dict) and (
        chat_template_kwargs.get("chat_template") is not None
    )
    if trusted or (chat_template is None and not in_kwargs):
        return
    raise ApiError(
        400,
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template.",
        "chat_template",
    )


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages for the template: a role each, content a string (text parts joined)."""
    if not messages:
        raise ApiError(400, "messages is an empty list: give at least one message", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] is not an object", "messages")
        check_strings(message, f"messages[{i}]", "messages")  # the template may render any field
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}] has no 'role' (a string)", "messages")
        checked.append({**message, "content": _message_text(message.get("content"), i)})
    return checked


def _message_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400,
            f"messages[{index}].content must be a string or a list of text parts",
            "messages",
        )
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(
                400,
                f"messages[{index}].content has a part of type {kind!r}; only text parts are "
                "supported",
                "messages",
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _value_kind(value: Any) -> str:
    if isinstance(value, float):
        return f"the number {value!r}" if value == value else "NaN"
    return f"of type {type_name(value)}"


def type_name(value: Any) -> str:
    return {type(None): "null", dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def format_batch_error(error: BatchInputError, param: str) -> str:
    shown = [f"{param}[{e.index}]: {e.message}" for e in error.errors[:_MAX_ERRORS_SHOWN]]
    more = len(error.errors) - _MAX_ERRORS_SHOWN
    return "; ".join(shown) + (f" (and {more} more invalid inputs)" if more > 0 else "")


def sampling_params_of(
    req: p.SamplingRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The sampling fields of a completions or chat request, checked (400 naming the field)."""
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        for i, stop in enumerate(stops):
            check_text(stop, f"stop[{i}]", "stop")
    _check_seed(req.seed, req.n)
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise ApiError(
            400, f"at most {MAX_LOGPROBS} logprobs per position, got {logprobs}", "logprobs"
        )
    fields: dict[str, Any] = dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise ApiError(400, str(e), _param_of(str(e), fields)) from e


def _check_seed(seed: int | None, n: int) -> None:
    """A seed torch's generators take: completion k of n is seeded with seed + k."""
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX - max(n - 1, 0):
        raise ApiError(
            400,
            f"seed must be in [{SEED_MIN}, {SEED_MAX}] (with n = {n}: at most "
            f"{SEED_MAX - max(n - 1, 0)}), got {seed}",
            "seed",
        )


def _param_of(message: str, fields: dict[str, Any]) -> str | None:
    name = message.split(" ", 1)[0]
    return name if name in fields else None
