"""Score templates: how a decoder reranker reads a (query, document) pair as ONE prompt.

A cross-encoder built on a causal LM (Qwen3-Reranker) is trained on a chat-formatted prompt, not on
the tokenizer's pair encoding. The template has the placeholders `{query}` and `{document}` (each
exactly once) and optionally `{instruction}`; the instruction is filled in once, when the engine
is configured, and each pair is rendered by plain concatenation (a `{` in a user's text is never
interpreted). Worked example with the built-in Qwen3-Reranker template:

    <|im_start|>system\\nJudge whether ... "yes" or "no".<|im_end|>\\n<|im_start|>user\\n
    <Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

Everything before `{document}` is the same for every document of one query, so the prefix cache
computes it once per rerank call (docs/llm_rerankers.md measures it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidepool.params import PoolingParams

QWEN3_RERANKER_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
QWEN3_RERANKER_TEMPLATE = (
    f"<|im_start|>system\n{QWEN3_RERANKER_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
QWEN3_RERANKER_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)

# Named templates a user may pass as `score_template`, with their default instruction.
BUILTIN_TEMPLATES: dict[str, tuple[str, str]] = {
    "qwen3_reranker": (QWEN3_RERANKER_TEMPLATE, QWEN3_RERANKER_INSTRUCTION),
}
NO_TEMPLATE = "none"
"""`score_template="none"`: pairs use the tokenizer's pair encoding, as without a template."""

_PLACEHOLDER = re.compile(r"\{(query|document|instruction)\}")


@dataclass(frozen=True)
class ScoreTemplate:
    """A parsed template: literal parts around the query and the document, in template order."""

    parts: tuple[str, str, str]
    """Text before the first placeholder, between the two, after the second."""
    query_first: bool
    """`{query}` comes before `{document}`."""

    @classmethod
    def parse(cls, template: str) -> ScoreTemplate:
        """ValueError unless `template` has `{query}` and `{document}` exactly once each (and any
        `{instruction}` already filled in)."""
        found = _PLACEHOLDER.findall(template)
        problems = [
            f"{{{name}}} {'is missing' if found.count(name) == 0 else 'appears more than once'}"
            for name in ("query", "document")
            if found.count(name) != 1
        ]
        if "instruction" in found:
            problems.append("{instruction} was not filled in")
        if problems:
            raise ValueError(
                "the score template needs the placeholders {query} and {document}, each exactly "
                f"once: {'; '.join(problems)}"
            )
        head, first, middle, _, tail = _PLACEHOLDER.split(template)
        return cls((head, middle, tail), query_first=first == "query")

    def render(self, query: str, document: str) -> str:
        first, second = (query, document) if self.query_first else (document, query)
        head, middle, tail = self.parts
        return f"{head}{first}{middle}{second}{tail}"


def render_pairs(
    template: ScoreTemplate,
    pairs: Sequence[tuple[Any, Any]],
    params: Sequence[PoolingParams],
    side_error: Callable[[str, Any], str | None],
) -> tuple[dict[int, str], dict[int, str]]:
    """(pair index → its prompt, pair index → why it has none). `side_error(side, value)`: the
    input processor's check of one text of a pair."""
    texts: dict[int, str] = {}
    errors: dict[int, str] = {}
    for i, (query, document) in enumerate(pairs):
        problems = [
            msg
            for side, value in (("first", query), ("second", document))
            if (msg := side_error(side, value))
        ]
        if params[i].truncate_prompt_tokens is not None:
            # Cutting the prompt's end would cut the template's answer prefix.
            problems.append("truncate_prompt_tokens is not supported with a score template")
        if problems:
            errors[i] = "; ".join(problems)
        else:
            texts[i] = template.render(query, document)
    return texts, errors


def _is_qwen3_reranker(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "is_original_qwen3_reranker", False))


def resolve_score_template(
    score_template: str | None, instruction: str | None, hf_config: Any
) -> str | None:
    """The template pairs are rendered with (instruction filled in), or None for the tokenizer's
    pair encoding. `score_template`: a built-in name (BUILTIN_TEMPLATES), a file holding the
    template, the template text itself, "none", or None (Qwen3-Reranker's built-in template when
    the model is one: `hf_overrides` with `is_original_qwen3_reranker`). ValueError for a template
    without its placeholders."""
    if score_template is None:
        if not _is_qwen3_reranker(hf_config):
            if instruction is not None:
                raise ValueError("score_instruction needs a score template (score_template=...)")
            return None
        score_template = "qwen3_reranker"
    if score_template == NO_TEMPLATE:
        return None
    if score_template in BUILTIN_TEMPLATES:
        text, default_instruction = BUILTIN_TEMPLATES[score_template]
    else:
        text, default_instruction = _read_template(score_template), ""
    filled = text.replace(
        "{instruction}", default_instruction if instruction is None else instruction
    )
    ScoreTemplate.parse(filled)  # fail at configuration, not on the first request
    return filled


def _read_template(value: str) -> str:
    if "{" not in value and len(value) < 4096:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return value
