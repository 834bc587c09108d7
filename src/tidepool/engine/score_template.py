"""Score templates: how a decoder reranker reads a (query, document) pair as ONE prompt.

Without a template asked for, a causal LM read as a reranker (hf_overrides `classifier_from_token`,
vLLM's `method`) reads each pair as vLLM 0.32 does: the two texts concatenated, `first + second`,
tokenized as one text (vLLM's `use_sep_token` False; `hf_overrides={"use_sep_token": True}` gives
the tokenizer's pair encoding instead). That is vLLM's documented Qwen3-Reranker usage: the user
formats the query (prefix, `<Instruct>`, `<Query>`) and the documents (`<Document>`, suffix)
themselves, and tidepool must not format them a second time. Other cross-encoders use the
tokenizer's pair encoding.

A template is applied only when asked for (`score_template=`, `--score-template`). It has the
placeholders `{query}` and `{document}` (each exactly once) and optionally `{instruction}`; the
instruction is filled in once, when the engine is configured, and each pair is rendered by plain
concatenation (a `{` in a user's text is never interpreted). Worked example with the built-in
Qwen3-Reranker template (`score_template="qwen3_reranker"`, for plain queries and documents):

    <|im_start|>system\\nJudge whether ... "yes" or "no".<|im_end|>\\n<|im_start|>user\\n
    <Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

Everything before `{document}` is the same for every document of one query, so the prefix cache
computes it once per rerank call (docs/llm_rerankers.md measures it).
"""

from __future__ import annotations

import logging
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
"""`score_template="none"`: no template, the same as not passing one."""
CONCATENATION = "{query}{document}"
"""vLLM's reading of a pair for an LM used as a reranker: the two texts as one, unformatted."""

logger = logging.getLogger("tidepool")

_PLACEHOLDER = re.compile(r"\{(query|document|instruction)\}")


@dataclass(frozen=True)
class ScoreTemplate:
    """A parsed template: literal parts around the query and the document, in template order."""

    parts: tuple[str, str, str]
    """Text before the first placeholder, between the two, after the second."""
    query_first: bool
    """`{query}` comes before `{document}`."""

    @property
    def is_concatenation(self) -> bool:
        """The pair is `query + document` and nothing else (CONCATENATION)."""
        return self.query_first and self.parts == ("", "", "")

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
        if params[i].truncate_prompt_tokens is not None and not template.is_concatenation:
            # Cutting the prompt's end would cut the template's answer prefix (vLLM's
            # concatenation of the user's own texts is cut as one text, as vLLM cuts it).
            problems.append("truncate_prompt_tokens is not supported with a score template")
        if problems:
            errors[i] = "; ".join(problems)
        else:
            texts[i] = template.render(query, document)
    return texts, errors


def _is_qwen3_reranker(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "is_original_qwen3_reranker", False))


def concatenates_pairs(hf_config: Any) -> bool:
    """vLLM's `use_sep_token` is False: an LM read as a reranker (its head built from
    `classifier_from_token` rows: vLLM sets `method` for it) unless hf_overrides say
    `use_sep_token: true`; any sequence classifier whose config says `use_sep_token: false`."""
    use_sep_token = getattr(hf_config, "use_sep_token", None)
    if getattr(hf_config, "classifier_method", None):  # model_loader/resolve.py wrote it
        return not use_sep_token
    architectures = getattr(hf_config, "architectures", None) or ()
    return use_sep_token is False and any(
        str(a).endswith("ForSequenceClassification") for a in architectures
    )


def resolve_score_template(
    score_template: str | None, instruction: str | None, hf_config: Any
) -> str | None:
    """The template pairs are rendered with (instruction filled in), or None for the tokenizer's
    pair encoding. `score_template`: a built-in name (BUILTIN_TEMPLATES), a file holding the
    template, the template text itself, or None / "none": no template, which for an LM read as a
    reranker is vLLM's plain concatenation (CONCATENATION: the user formats the texts). ValueError
    for a name that is none of these, a template without its placeholders, or an instruction
    without a template."""
    if score_template is None or score_template == NO_TEMPLATE:
        if instruction is not None:
            raise ValueError(
                "score_instruction fills the {instruction} of a score template, and none was "
                "asked for: pass score_template='qwen3_reranker' (or a template of your own) too"
            )
        if not concatenates_pairs(hf_config):
            return None
        if _is_qwen3_reranker(hf_config) and score_template is None:  # "none": chosen knowingly
            logger.warning(
                "Qwen3-Reranker without a score template: each pair is read as vLLM reads it, "
                "the two texts concatenated as given; format them as vLLM's Qwen3-Reranker "
                "example does (prefix, <Instruct>, <Query> / <Document>, suffix), or pass "
                "score_template='qwen3_reranker' (--score-template qwen3_reranker) to have "
                "tidepool format plain queries and documents"
            )
        return CONCATENATION
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
    """The template in the file `value`, or `value` itself when it holds a placeholder."""
    if "{" not in value and len(value) < 4096:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        names = ", ".join(repr(n) for n in (*BUILTIN_TEMPLATES, NO_TEMPLATE))
        raise ValueError(
            f"score_template={value!r} is not a built-in template ({names}), not a file, and "
            "not a template (a text with {query} and {document})"
        )
    return value
