"""Tokenize only as much of a text as the tokens wanted from it: a 30 MB text costs what it keeps.

Why a prefix gives the text's own first tokens: the tokenizer normalizes the text, splits it into
words (pre-tokens: whitespace, punctuation, the byte-level regex, Metaspace's "▁") and tokenizes
each word on its own. Cutting the text at character C can change only the word the cut falls in,
and an added token (a literal "[SEP]", "<|eos|>") that straddles the cut. So the tokens of the
prefix are trusted ("safe") up to the word that holds the cut, and none that ends within the last
M characters (M: the longest added token):

    text:    "the tide pool is dee|per than it looks"        (cut at |)
    prefix:  the · tide · pool · is · dee                     "dee" holds the cut: dropped
    safe:    the · tide · pool · is                           = the full text's first 4 tokens

When the safe tokens are fewer than wanted, the prefix grows (by the token density seen so far,
at least 2x) until it gives enough, reaches the end of the text (then every token is known), or
reaches the read limit: `CHARS_PER_TOKEN` characters per wanted token (at least `MIN_CHARS`).
Ordinary text has 1-10 characters per token, so the limit is only met by texts made of whitespace
or of very long words; the caller refuses those with a message (never a wrong token).

Thread safety: `PrefixTokenizer` keeps its own copy of the Rust tokenizer with truncation and
padding off, set once at construction and never changed, and truncates each call's encodings
itself, so any number of threads may call it at once (`encode_batch` releases the GIL).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer

from tidepool.utils.lists import filled

MIN_CHARS = 4096
"""A text of up to this many characters is read whole in one go (a few milliseconds)."""
FIRST_CHARS_PER_TOKEN = 8
"""The first prefix has this many characters per wanted token (enough for ordinary text)."""
CHARS_PER_TOKEN = 64
"""The read limit: at most this many characters per wanted token (and at least MIN_CHARS)."""


def read_limit(num_tokens: int) -> int:
    """Most characters read from a text to find its first `num_tokens` tokens."""
    return max(MIN_CHARS, CHARS_PER_TOKEN * num_tokens)


@dataclass(frozen=True)
class FirstTokens:
    """The first tokens of one text, without special tokens."""

    token_ids: list[int]
    """All of the text's tokens when `complete`, else only those the cut cannot change."""
    complete: bool
    """The whole text was read: `token_ids` holds every token, so its length is the text's."""
    num_chars_read: int
    """Characters of the text that were tokenized (the whole text when `complete`)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class _Piece:
    """One part of a post-processor's output: a special token, or where a sequence goes."""

    token_id: int | None
    """The special token's id; None for a sequence."""
    sequence: int | None
    """0 (first text) or 1 (second text) for a sequence; None for a special token."""
    type_id: int
    """Token type of the special token, or of every token of the sequence."""


class PrefixTokenizer:
    """Batched tokenization of text prefixes; safe to call from several threads at once."""

    def __init__(self, backend: Tokenizer) -> None:
        # Our own copy: transformers' tokenizer sets truncation on its backend at every call, and
        # a tokenizer.json may come with truncation and padding on; ours never changes after this.
        self._backend = Tokenizer.from_str(backend.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        added = self._backend.get_added_tokens_decoder().values()
        self._margin = max((len(t.content) for t in added), default=0) + 1
        self._templates: dict[tuple[bool, bool], tuple[_Piece, ...] | None] = {}
        for pair in (False, True):
            for special in (False, True):
                try:
                    self._templates[pair, special] = self._template(pair, special)
                except Exception:  # a decoder's post-processor may have no pair template
                    self._templates[pair, special] = None

    def _template(self, pair: bool, add_special_tokens: bool) -> tuple[_Piece, ...]:
        """The post-processor's layout, read off one sample: special tokens are added around the
        texts' tokens, which it never changes (BERT, RoBERTa, template processors). Adding them
        ourselves keeps truncation in plain lists: `Encoding.truncate` keeps the cut-off tokens
        as overflow, which post-processing then multiplies (0.5 s for two long pair texts)."""
        sample = next(
            e
            for e in self._backend.encode_batch(["a", "x", "0", "."], add_special_tokens=False)
            if e.ids
        )
        done = self._backend.post_process(sample, sample if pair else None, add_special_tokens)
        pieces: list[_Piece] = []
        num_runs = 0  # the k-th run of text tokens is text k (`sequence_ids` misses the first)
        was_special = True
        for token_id, special, type_id in zip(
            done.ids, done.special_tokens_mask, done.type_ids, strict=True
        ):
            if special:
                pieces.append(_Piece(token_id, None, type_id))
            elif was_special:
                pieces.append(_Piece(None, num_runs, type_id))
                num_runs += 1
            was_special = bool(special)
        if num_runs != (2 if pair else 1):
            raise ValueError(f"unexpected post-processor layout {done.tokens}")
        return tuple(pieces)

    def num_special_tokens(self, pair: bool, add_special_tokens: bool = True) -> int:
        template = self._templates[pair, add_special_tokens]
        if template is None:
            raise ValueError("this tokenizer has no template for text pairs")
        return sum(p.sequence is None for p in template)

    def with_special_tokens(
        self, first: list[int], second: list[int] | None = None, add_special_tokens: bool = True
    ) -> tuple[list[int], list[int]]:
        """(token ids, token type ids) of one prompt: the texts' tokens with special tokens."""
        ids: list[int] = []
        types: list[int] = []
        template = self._templates[second is not None, add_special_tokens]
        if template is None:
            raise ValueError("this tokenizer has no template for text pairs")
        for piece in template:
            if piece.sequence is None:
                assert piece.token_id is not None  # a special token's piece
                ids.append(piece.token_id)
                types.append(piece.type_id)
            else:
                tokens = first if piece.sequence == 0 else second
                assert tokens is not None  # the pair template is chosen for a second text
                ids.extend(tokens)
                types.extend([piece.type_id] * len(tokens))
        return ids, types

    def first_tokens(
        self,
        texts: Sequence[str],
        num_wanted: Sequence[int],
        prepare: Callable[[str], str] | None = None,
    ) -> list[FirstTokens]:
        """For each text, at least its first `num_wanted[i]` tokens (all of them when it has
        fewer), unless the read limit comes first: then fewer, and `complete` is False.
        `prepare` maps a prefix of the raw text to what is tokenized (prompt, lower-casing)."""
        results: list[FirstTokens | None] = [None] * len(texts)
        num_chars = [
            _clamp(max(MIN_CHARS, FIRST_CHARS_PER_TOKEN * n), len(t), read_limit(n))
            for t, n in zip(texts, num_wanted, strict=True)
        ]
        pending = list(range(len(texts)))
        while pending:
            prefixes = [texts[i][: num_chars[i]] for i in pending]
            if prepare is not None:
                prefixes = [prepare(p) for p in prefixes]
            encodings = self._backend.encode_batch(prefixes, add_special_tokens=False)
            still_pending = []
            for i, prefix, enc in zip(pending, prefixes, encodings, strict=True):
                read = num_chars[i]
                if read >= len(texts[i]):
                    results[i] = FirstTokens(enc.ids, True, read)
                    continue
                num_safe = self._num_safe(enc, len(prefix))
                limit = read_limit(num_wanted[i])
                if num_safe >= num_wanted[i] or read >= limit:
                    results[i] = FirstTokens(enc.ids[:num_safe], False, read)
                    continue
                # Grow by the density seen so far (x1.25 to overshoot), at least doubling.
                guess = read * num_wanted[i] * 5 // (4 * num_safe) if num_safe else 4 * read
                num_chars[i] = _clamp(max(2 * read, guess), len(texts[i]), limit)
                still_pending.append(i)
            pending = still_pending
        return filled(results)

    def _num_safe(self, enc: Encoding, prefix_len: int) -> int:
        """How many leading tokens of a cut prefix's encoding equal the full text's."""
        word_ids = enc.word_ids
        if not word_ids:
            return 0
        cut_word = word_ids[-1]
        end_limit = prefix_len - self._margin
        for k, (word, (_, end)) in enumerate(zip(word_ids, enc.offsets, strict=True)):
            if word == cut_word or word is None or end > end_limit:
                return k
        return len(word_ids)


def _clamp(num_chars: int, text_len: int, limit: int) -> int:
    # Reading most of a text costs about what reading all of it does, and then every token is
    # known: past 3/4 of the text, read it whole (never past the read limit).
    num_chars = min(num_chars, limit)
    return text_len if num_chars * 4 >= text_len * 3 and text_len <= limit else num_chars
