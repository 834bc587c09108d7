"""Request and response schemas of the OpenAI-compatible server, with vLLM's field names.

Schemas only: no logic beyond field types and defaults. Every field vLLM 0.32 defines is declared
(and honoured or refused by name: serving_vllm.py); other unknown fields are accepted and ignored
(as vLLM and OpenAI do), so clients that send extras work unchanged. The content fields (`input`, `text_1`, `documents`...) are typed loosely on purpose:
the server checks them itself to answer 400 with the exact reason ("input[3] is an empty string")
instead of a generic schema error. Every other field is strict: no coercion, so `dimensions: "8"`,
`8.0` or `true` and `normalize: "yes"` are refused (422 naming the field) instead of guessed at;
a float field takes an integer (JSON has one number type) but not NaN or Infinity.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
)

EmbedDType = Literal[
    "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "uint8", "binary", "ubinary"
]
"""vLLM's names (float32 ... fp8_e5m2) and sentence-transformers' quantized precisions
(tidepool.quantize's; the protocol imports no engine code)."""
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
"""vLLM's: "bytes" answers the values as one binary body (application/octet-stream) with a
`metadata` header (JSON: each input's byte range and shape); "bytes_only" without it."""

# Strict request field types (what the docs promise a 422 for). Python's json module reads NaN
# and Infinity, which no sampling or pooling value can mean.
Int = StrictInt
Bool = StrictBool
Str = StrictStr
Float = Annotated[float, Strict(), AllowInfNan(False)]


from tidepool.entrypoints.openai.protocol_vllm import (  # noqa: E402
    ChatFields,
    PoolingFields,
    PromptTokenUsageInfo,
    ScoringFields,
    TokenizeChatFields,
)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# ---------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int
    """The HTTP status, as vLLM sets it."""


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
"""OpenAI's error `type` for each HTTP status."""


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """OpenAI's error JSON, as vLLM fills it: `code` is the HTTP status."""
    error = ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status
    )
    return ErrorResponse(error=error)


# ---------------------------------------------------------------------- shared


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class _ListResponse(OpenAIBaseModel):
    """The answer of /v1/embeddings, /pooling, /classify and /score: one `data` item per input.
    Each subclass narrows `data` and gives `id` its prefix; a field redeclared in a subclass keeps
    its place here, so the keys of every answer keep this order."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[Any]
    usage: UsageInfo


# ---------------------------------------------------------------------- embeddings / pooling


class EmbeddingRequest(PoolingFields, ChatFields):
    model: Str | None = None
    input: Any
    """A string, a list of strings, a list of token ids, or a list of token-id lists (or give
    `messages` instead)."""
    encoding_format: EncodingFormat = "float"
    dimensions: Int | None = None
    user: Str | None = None
    truncate_prompt_tokens: Int | None = None
    """Keep the first N tokens of each input; -1 = the model's maximum (vLLM extension)."""
    normalize: Bool | None = None
    """Older vLLM's name of use_activation for embeddings (kept as an alias)."""
    embed_dtype: EmbedDType = "float32"
    """The values' type (vLLM's field; int8 / uint8 / binary / ubinary are sentence-transformers'
    quantized precisions, a tidepool extension): docs/server.md, "Output encodings"."""
    endianness: Literal["native", "little", "big"] = "native"
    """Byte order of base64 values (vLLM's field); native = the server's (little on x86, ARM)."""
    prompt_name: Str | None = None
    """One of the model's prompts (config_sentence_transformers.json), put before each input
    (TEI's field); None = its default_prompt_name. ColBERT models: "query" or "document"."""


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[Any] | str
    """Floats (integers for the quantized embed dtypes), or base64; `Any` items: no per-value
    validation of what the server itself built."""


class EmbeddingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_id("embd"))
    data: list[EmbeddingResponseData]


class PoolingRequest(EmbeddingRequest):
    task: Str | None = None
    """"embed", "classify", "score", "token_embed"...; None = the model's own task."""
    activation: Bool | None = None


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[Any] | str


class PoolingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_id("pool"))
    data: list[PoolingResponseData]


# ---------------------------------------------------------------------- classify


class ClassificationRequest(PoolingFields, ChatFields):
    model: Str | None = None
    input: Any
    """A string or a list of strings (token ids also accepted), or give `messages` instead."""
    truncate_prompt_tokens: Int | None = None
    user: Str | None = None
    activation: Bool | None = None


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | list[str] | None
    """The likeliest label; a token classifier: one per token."""
    probs: list[float] | list[list[float]]
    """Per label; a token classifier: [num_tokens][num_labels]."""
    num_classes: int


class ClassificationResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_id("classify"))
    data: list[ClassificationData]


# ---------------------------------------------------------------------- score / rerank


class ScoreRequest(PoolingFields, ScoringFields):
    """One pair of fields, as vLLM takes them: `queries` / `documents` or `queries` / `items`
    (vLLM's current bodies), `text_1` / `text_2` or `data_1` / `data_2`."""

    model: Str | None = None
    text_1: Any = None
    """A string or a list of strings: 1-to-N against text_2 with one item, else N-to-N."""
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    truncate_prompt_tokens: Int | None = None
    activation: Bool | None = None


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_id("score"))
    data: list[ScoreResponseData]


class RerankRequest(PoolingFields, ScoringFields):
    model: Str | None = None
    query: Any
    documents: Any
    """Strings, objects with a "text" field (Cohere v1, Jina), or {"content": [parts]}."""
    top_n: Int | None = None
    """Keep the best N results; None or 0 = all."""
    return_documents: Bool = True
    truncate_prompt_tokens: Int | None = None
    activation: Bool | None = None


class RerankDocument(OpenAIBaseModel):
    text: str | None = None
    multi_modal: Any = None
    """An image document's image part (several: their list), as vLLM; its text parts: text."""


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# ---------------------------------------------------------------------- completions / chat


class StreamOptions(OpenAIBaseModel):
    include_usage: Bool | None = False
    """Send a last chunk with `usage` (and empty `choices`) before [DONE]."""
    continuous_usage_stats: Bool | None = False
    """Every chunk carries the usage so far (vLLM extension)."""


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model: Str | None = None
    n: Int = 1
    temperature: Float | None = None
    """None = 1.0."""
    top_p: Float | None = None
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    logit_bias: dict[str, Float] | None = None
    """Not supported: refused when not empty."""
    # vLLM extensions
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    truncate_prompt_tokens: Int | None = None
    """Keep only the last N prompt tokens."""


class CompletionRequest(SamplingRequest):
    prompt: Any
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: Int | None = 16
    """None = up to the model's maximum length."""
    logprobs: Int | None = None
    echo: Bool = False
    suffix: Str | None = None
    """Not supported: refused when given."""
    best_of: Int | None = None
    """Only best_of = n is accepted (vLLM V1 has no best_of either)."""
    add_special_tokens: Bool = True


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: Int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; both accepted."""
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    """Not supported: refused when not empty."""
    response_format: dict[str, Any] | None = None
    """Only {"type": "text"} is accepted."""
    chat_template: Str | None = None
    """A Jinja template that replaces the tokenizer's (vLLM extension)."""
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    """The chat template writes the special tokens (BOS) itself."""


class GenerationUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    """With --enable-prompt-tokens-details and a prefix-cache hit (as vLLM reports it)."""


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    """"stop" or "length"; None in a stream chunk before the last."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the text; None for EOS and length."""


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: GenerationUsage | None = None
    """Always set in a response; in a stream, only on the usage chunk(s)."""


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: GenerationUsage


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: dict[str, str]
    """{"role": "assistant", "content": ""} first, then {"content": text}; {} when a last chunk
    has no text."""
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: GenerationUsage | None = None


# ---------------------------------------------------------------------- tokenize


class TokenizeRequest(TokenizeChatFields):
    model: Str | None = None
    prompt: Str | None = None
    messages: list[Any] | None = None
    """Chat messages, rendered with the chat template (a generating model's)."""
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Str | None = None
    tokens: list[Int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---------------------------------------------------------------------- models


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = False
    allow_logprobs: bool = False
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tidepool"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(OpenAIBaseModel):
    version: str
