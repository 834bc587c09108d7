"""OpenAI's logprobs JSON of a completion (or of one streamed delta): the legacy completions form
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat form (`content`)."""

from __future__ import annotations

from typing import Any

from tidepool.entrypoints.openai import protocol as p
from tidepool.outputs import CompletionOutput, Logprob


def completion_logprobs(
    completion: CompletionOutput, text_offset: int
) -> tuple[p.CompletionLogProbs, int]:
    """The legacy completions logprobs of a completion (or a delta), and the text offset after."""
    result = p.CompletionLogProbs()
    for token_id, position in zip(completion.token_ids, completion.logprobs or (), strict=False):
        sampled = position.get(token_id)
        token = _token_text(sampled)
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob if sampled is not None else None)
        result.top_logprobs.append(
            {_token_text(lp): lp.logprob for lp in sorted(position.values(), key=_rank)}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


def chat_logprobs(completion: CompletionOutput, num_top: int | None) -> p.ChatChoiceLogProbs | None:
    """None when the request asked for no logprobs (`num_top` None)."""
    if num_top is None or completion.logprobs is None:
        return None
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):
        sampled = position.get(token_id)
        if sampled is None:
            continue
        tops = [lp for lp in sorted(position.values(), key=_rank) if lp.rank <= num_top]
        content.append(
            p.ChatLogProbsContent(
                **_chat_logprob(sampled),
                top_logprobs=[p.ChatLogProb(**_chat_logprob(lp)) for lp in tops[:num_top]],
            )
        )
    return p.ChatChoiceLogProbs(content=content)


def _chat_logprob(lp: Logprob) -> dict[str, Any]:
    token = _token_text(lp)
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def _token_text(lp: Logprob | None) -> str:
    return "" if lp is None or lp.decoded_token is None else lp.decoded_token


def _rank(lp: Logprob) -> int:
    return lp.rank
