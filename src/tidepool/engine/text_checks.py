"""What a text must be for the tokenizer to take it, checked before any tokenization.

Fuzzing the `tokenizers` library (WordPiece, byte-level BPE, Unigram; hypothesis over every code
point) found one kind of text it refuses: lone surrogates (U+D800..U+DFFF, which JSON's "\\ud800"
escape can produce and UTF-8 cannot encode); the Rust side raises a TypeError for the whole batch.
Everything else works and is accepted: NUL and other control characters (WordPiece drops them),
non-characters (U+FFFE, U+10FFFF: [UNK] or bytes), combining marks, right-to-left text and marks,
zero-width characters, very long strings (their cost is bounded by `prefix_tokenizer`).
"""

from __future__ import annotations


def unicode_problem(text: str) -> str | None:
    """Why the tokenizer cannot take `text`, as the end of a sentence ("has a lone surrogate ..."),
    or None when it can. O(len(text)) at C speed, O(1) for ASCII."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"has a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}; "
            "text must be valid Unicode (surrogates U+D800..U+DFFF cannot be encoded as UTF-8)"
        )
    return None
