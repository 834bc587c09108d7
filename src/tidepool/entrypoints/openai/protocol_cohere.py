"""Request and response schemas of Cohere's v2 embed API (`POST /v2/embed`), as Cohere's
documentation and its Python SDK (`cohere.ClientV2.embed`) write them.

/v2/rerank is vLLM's RerankRequest / RerankResponse (protocol.py): Cohere's SDK reads its `id` and
`results` ({index, relevance_score, document}) and ignores the rest.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidepool.entrypoints.openai.protocol import Int, Str, random_id

CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
"""Cohere's `embedding_types`; base64 = the float32 values' little-endian bytes."""


class CohereBaseModel(BaseModel):
    # Unknown fields are ignored, as Cohere's SDK may add some (`priority`).
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class CohereEmbedRequest(CohereBaseModel):
    model: Str | None = None
    texts: Any = None
    """A list of strings (Cohere takes at most 96; here --max-inputs-per-request)."""
    images: Any = None
    """Image data URLs (http(s) URLs and files as the server's media flags allow), one image
    input each; instead of texts (openai/media_inputs.py)."""
    inputs: Any = None
    """{"content": [text and image_url parts]} items, one input each; instead of texts."""
    input_type: (
        Literal["search_document", "search_query", "classification", "clustering", "image"] | None
    ) = None
    """Checked, then used to pick the model's sentence-transformers prompt of that name (e.g.
    "query" for search_query); a model without such prompts embeds every type the same."""
    embedding_types: list[CohereEmbeddingType] | None = None
    """None = ["float"]."""
    output_dimension: Int | None = None
    """Matryoshka: the first N values, renormalized (the OpenAI route's `dimensions`)."""
    max_tokens: Int | None = None
    """Most tokens per input (special tokens included); longer texts are cut as `truncate` says."""
    truncate: Literal["NONE", "START", "END"] = "END"
    """END cuts the end of a long text, START its start, NONE refuses it (400)."""


class CohereApiVersion(CohereBaseModel):
    version: str = "2"


class CohereBilledUnits(CohereBaseModel):
    input_tokens: int


class CohereMeta(CohereBaseModel):
    api_version: CohereApiVersion = Field(default_factory=CohereApiVersion)
    billed_units: CohereBilledUnits


class CohereImage(CohereBaseModel):
    """An embedded image, as Cohere describes it (of the encoded image it was sent as)."""

    width: int
    height: int
    format: str
    bit_depth: int


class CohereEmbedResponse(CohereBaseModel):
    id: str = Field(default_factory=lambda: random_id("embed"))
    embeddings: dict[str, list[Any]]
    """One list per requested type ("float", "int8"...), each with one embedding per input."""
    texts: list[str] | None = None
    """The texts of a `texts` request (the text parts of an `inputs` request)."""
    images: list[CohereImage] | None = None
    """The images of an `images` request."""
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
