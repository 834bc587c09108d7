"""Generating prompts' token ids: read as a whole prefix up to one token over max_model_len (a
longer one is refused without reading the rest), or whole when their last tokens are kept; and
where generation stops (EOS ids)."""

from __future__ import annotations

from typing import Any

from tidepool.config import ModelConfig
from tidepool.engine.prefix_tokenizer import CHARS_PER_TOKEN, PrefixTokenizer, read_limit
from tidepool.engine.truncation import too_long, too_sparse


def tokenize_generate(
    prefix_tokenizer: PrefixTokenizer,
    max_model_len: int,
    texts: list[str],
    keeps_last: list[bool],
    add_special_tokens: bool,
) -> list[list[int] | str]:
    """Token ids (special tokens included) of each text, or why it is refused. Without
    truncation, a prefix one token over the limit refuses a text; keeping the last tokens
    needs the whole text, so its length is capped by the read limit instead."""
    num_special = prefix_tokenizer.num_special_tokens(False, add_special_tokens)
    num_wanted = max(max_model_len - num_special, 0) + 1
    limit = read_limit(max_model_len)
    out: list[list[int] | str] = []
    readable = [k for k, text in enumerate(texts) if not (keeps_last[k] and len(text) > limit)]
    firsts = prefix_tokenizer.first_tokens(
        [texts[k] for k in readable],
        # Wanting as many tokens as characters makes the read limit cover the whole text.
        [len(texts[k]) if keeps_last[k] else num_wanted for k in readable],
    )
    by_index = dict(zip(readable, firsts, strict=True))
    for k, text in enumerate(texts):
        first = by_index.get(k)
        if first is None:
            out.append(
                f"the prompt has {len(text):,} characters; truncate_prompt_tokens keeps the "
                "last tokens, which needs the whole text read, and tidepool reads at most "
                f"{limit:,} ({CHARS_PER_TOKEN} per token of max_model_len): shorten it"
            )
        elif not first.complete:
            out.append(
                too_sparse("the prompt", first, num_wanted, len(text))
                if first.num_tokens < num_wanted
                else too_long(
                    max_model_len,
                    "the prompt",
                    first.num_tokens + num_special,
                    first.num_chars_read,
                    len(text),
                )
            )
        else:
            ids, _ = prefix_tokenizer.with_special_tokens(first.token_ids, None, add_special_tokens)
            out.append(ids)
    return out


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Where generation stops: generation_config.json's EOS ids, then the tokenizer's if it is not
    among them."""
    ids = list(model_config.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(int(tokenizer_eos))
    return tuple(ids)
