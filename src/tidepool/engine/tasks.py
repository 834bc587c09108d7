"""Which calls a model can serve, checked up front (before any prompt is tokenized).

One rule for the offline `LLM`: a call the model cannot serve at all (`.embed` on a cross-encoder,
`.classify` on an embedder) raises ValueError before any work, naming the model and what it is
for. The tasks come from `ModelConfig.pooling_tasks`, which the pooler also checks each request against;
the words from the model's output head (output_heads/: its kind, what each task needs).
"""

from __future__ import annotations

from tidepool.config import ModelConfig
from tidepool.output_heads import get_head, task_needs
from tidepool.params import known_pooling_tasks


def supported_tasks(model_config: ModelConfig) -> tuple[str, ...]:
    """The pooling tasks of a model (`ModelConfig.pooling_tasks`, which the pooler reads too)."""
    return model_config.pooling_tasks


_KIND = {"embed": "an embedding model", "classify": "a classification model", "generate": "a "
         "generating model"}  # fmt: skip


def model_kind(model_config: ModelConfig) -> str:
    """What the model is, for refusals: its output head's kind, else its task's."""
    kind = get_head(model_config.output_head).kind
    return kind or _KIND.get(model_config.task, f"a {model_config.task} model")


def check_task_supported(model_config: ModelConfig, task: str) -> None:
    """Raise ValueError, before any work, if the model cannot serve `task` ("embed", "classify",
    "score", "token_embed", "token_classify", or a task an output head declares). "score" also
    works on embedding models (the cosine of two embeddings)."""
    if task not in known_pooling_tasks():
        raise ValueError(f"unknown pooling task {task!r}; expected one of {known_pooling_tasks()}")
    tasks = supported_tasks(model_config)
    # An embedding model scores by cosine, a ColBERT model (token_embed only) by MaxSim.
    if task in tasks or (task == "score" and ("embed" in tasks or "token_embed" in tasks)):
        return
    needs = task_needs(task)
    kind = model_kind(model_config)
    offers = f"it supports {', '.join(tasks)}" if tasks else "it serves no pooling task"
    hint = _GENERATOR_HINTS.get(task, "") if model_config.task == "generate" else ""
    raise ValueError(
        f"{task}() needs {needs} ({model_config.architecture} is {kind}; {offers}){hint}"
    )


_POOLING_RUNNER = '; load it with runner="pooling"'
_GENERATOR_HINTS = {
    "embed": f"{_POOLING_RUNNER} to embed with its last token's hidden state (LAST pooling)",
    "token_embed": f"{_POOLING_RUNNER} for its hidden states",
    "score": f'{_POOLING_RUNNER} to score by embeddings, or with convert="classify" (and '
    'hf_overrides={"classifier_from_token": [...]} for a reranker that answers with tokens)',
    "classify": f'{_POOLING_RUNNER}, convert="classify" (a checkpoint with score.weight, or '
    'hf_overrides={"classifier_from_token": [...]})',
}
"""What a generating model (a *ForCausalLM loaded with runner="auto") needs for a pooling call."""
