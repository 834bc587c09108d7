"""Instruction prompts: a request's `prompt_name` → the text put before each of its inputs.

The prompts are the model's (config_sentence_transformers.json's `prompts`, with
`default_prompt_name` used when a request names none), applied as sentence-transformers does:
the prompt text is prepended to the input text, then the whole is tokenized and counted against
max_model_len. Examples: e5 {"query": "query: ", "passage": "passage: "}, Qwen3-Embedding
{"query": "Instruct: ...\\nQuery:", "document": ""}, EmbeddingGemma's task prompts.

ColBERT models (ModelConfig.multi_vector) also know "query" and "document": they choose how an
input is encoded (its marker token, [MASK] expansion for queries, punctuation dropped from
documents); a text without a prompt name is a document.

Pure functions: the offline `LLM` and the server call them up front (an unknown name is a
ValueError there, a 400 here), the input processor when it builds each request.
"""

from __future__ import annotations

from tidepool.config import ModelConfig

MULTI_VECTOR_ROLES = ("query", "document")
"""The prompt names every multi-vector model knows."""

COHERE_INPUT_TYPES: dict[str, tuple[str, ...]] = {
    "search_query": ("query", "search_query", "retrieval-query", "retrieval_query"),
    "search_document": (
        "document",
        "passage",
        "search_document",
        "retrieval-document",
        "retrieval_document",
        "corpus",
    ),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
"""Cohere's input_type → the model's prompt names it may mean, most likely first (matched without
regard to case)."""


def prompt_names(model_config: ModelConfig) -> tuple[str, ...]:
    """Every prompt name a request to this model may give."""
    names = set(model_config.st.prompts)
    if model_config.multi_vector is not None:
        names.update(MULTI_VECTOR_ROLES)
    return tuple(sorted(names))


def check_prompt_name(model_config: ModelConfig, prompt_name: str | None) -> None:
    """ValueError for a name the model does not have (listing those it has)."""
    if prompt_name is None or prompt_name in prompt_names(model_config):
        return
    if not isinstance(prompt_name, str):
        raise ValueError(f"prompt_name must be a string, got {type(prompt_name).__name__}")
    names = prompt_names(model_config)
    has = f"its prompts are: {', '.join(names)}" if names else "it has no prompts"
    raise ValueError(
        f"unknown prompt_name {prompt_name!r}: {has} (config_sentence_transformers.json)"
    )


def effective_prompt_name(model_config: ModelConfig, prompt_name: str | None) -> str | None:
    """The name a request runs with: its own, else the model's default_prompt_name."""
    return prompt_name if prompt_name is not None else model_config.st.default_prompt_name


def prompt_text(model_config: ModelConfig, prompt_name: str | None) -> str:
    """The text put before a request's inputs ("" for none). Assumes a checked name."""
    name = effective_prompt_name(model_config, prompt_name)
    return model_config.st.prompts.get(name, "") if name is not None else ""


def is_query(model_config: ModelConfig, prompt_name: str | None) -> bool:
    """A multi-vector model encodes this request's inputs as queries."""
    return (
        model_config.multi_vector is not None
        and effective_prompt_name(model_config, prompt_name) == "query"
    )


def prompt_name_for_input_type(model_config: ModelConfig, input_type: str | None) -> str | None:
    """Cohere's `input_type` (search_query, search_document, classification, clustering) → the
    model's prompt name for it; None when the model has none (the input runs without a prompt).
    ValueError for an input_type Cohere does not define."""
    if input_type is None:
        return None
    if input_type not in COHERE_INPUT_TYPES:
        raise ValueError(
            f"unknown input_type {input_type!r}; expected one of {', '.join(COHERE_INPUT_TYPES)}"
        )
    by_lower = {name.lower(): name for name in prompt_names(model_config)}
    for candidate in COHERE_INPUT_TYPES[input_type]:
        if candidate in by_lower:
            return by_lower[candidate]
    return None
