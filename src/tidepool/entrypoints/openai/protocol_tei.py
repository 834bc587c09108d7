"""Request and response schemas of text-embeddings-inference's native routes (/embed, /embed_all,
/rerank, /predict, /tokenize), with TEI's field names and defaults. TEI answers bare JSON arrays:
the response types here are the array items."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, RootModel

from tidepool.entrypoints.openai.protocol import Bool, Int, OpenAIBaseModel, Str

TruncationDirection = Literal["Left", "Right"]
"""TEI's names: Right cuts the end of a long text, Left its start."""


class TeiBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class _Truncation(TeiBaseModel):
    truncate: Bool | None = None
    """Cut a text longer than the model (TEI's default: no, refuse it with an error)."""
    truncation_direction: TruncationDirection = "Right"


class TeiEmbedRequest(_Truncation):
    inputs: Any
    """A string, a list of strings, a list of token ids or a list of token-id lists."""
    normalize: Bool = True
    prompt_name: Str | None = None
    """One of the model's sentence-transformers prompts, put before each text."""
    dimensions: Int | None = None


class TeiEmbedAllRequest(_Truncation):
    inputs: Any
    prompt_name: Str | None = None


class TeiRerankRequest(_Truncation):
    query: Any
    texts: Any
    raw_scores: Bool = False
    """Scores before the sigmoid / softmax."""
    return_text: Bool = False
    return_documents: Bool | None = None
    """Same as return_text (the name of the other rerank routes); either one set → texts back."""
    top_n: Int | None = None
    """Keep the best N (an extension: TEI returns all); None or 0 = all."""


class TeiPredictRequest(_Truncation):
    inputs: Any
    """A text, a pair [text, text], or a list of texts and pairs."""
    raw_scores: Bool = False


class TeiTokenizeRequest(TeiBaseModel):
    inputs: Any
    """A string or a list of strings."""
    add_special_tokens: Bool = True
    prompt_name: Str | None = None


class TeiRank(TeiBaseModel):
    index: int
    score: float
    text: str | None = None


class TeiPrediction(TeiBaseModel):
    score: float
    label: str


class TeiToken(TeiBaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    """Character offset in the text; None for a special token."""
    stop: int | None


# /embed_sparse: TEI's shape, checked as strictly as the OpenAI routes (OpenAIBaseModel).


class EmbedSparseRequest(OpenAIBaseModel):
    """TEI's /embed_sparse request."""

    inputs: Any
    """A string or a list of strings (token ids also accepted)."""
    truncate: Bool = False
    """Cut inputs longer than the model's maximum (else they are a 400)."""
    truncation_direction: Str = "Right"
    model: Str | None = None
    max_active_dims: Int | None = None
    """Keep the largest this many weights of each input (sentence-transformers' name)."""
    prompt_name: Str | None = None
    """One of the model's prompts put before each text (TEI's field, as on /embed); None: its
    default_prompt_name."""


class SparseValue(OpenAIBaseModel):
    index: int
    """The token id."""
    value: float
    """Its weight (> 0)."""


class EmbedSparseResponse(RootModel[list[list[SparseValue]]]):
    """TEI's /embed_sparse answer: per input, its non-zero (token id, weight) pairs."""
