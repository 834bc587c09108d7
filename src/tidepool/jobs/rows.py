"""The one row reader of every batch job: what a line is, what a row is, what makes a row bad.

Counting, planning (the Ray job's shards) and reading all go through `iter_row_lines`, so a row
index means the same thing everywhere:

- A **line** ends at a `\\n` byte (or at the end of the file); one `\\r` before it is dropped
  (CRLF files), and so is a UTF-8 byte-order mark opening the file. A lone `\\r` is *not* a
  line break: it stays inside the line. Splitting on bytes (not `str.splitlines`, which also
  breaks at `\\r`, `\\x0b`, `\\x1c`-`\\x1e`, `\\x85`, `\\u2028`, `\\u2029`) keeps valid JSON lines
  whole (JSON may hold a raw `\\u2028`), matches `wc -l`, an editor's line numbers and the byte
  ranges the Ray job plans.
- A line is **blank** when it is empty or holds only whitespace (`str.isspace`: Unicode
  whitespace such as `\\xa0` or `\\u3000` too). A blank line is not a row: it has no index and
  is never reported.
- Every other line is a **row**: `index` counts rows from 0 (what the outputs' `index` holds);
  `line` is its 1-based line number (what error reports give). Parquet rows have no line.
- A row is **bad** (`BadRow`, with the reason) when its text cannot be embedded: not UTF-8, not
  JSON (.jsonl), neither a JSON string nor an object with the text field, or a text that is not
  a non-empty, non-whitespace string of valid Unicode. The same check runs on parquet values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

_READ_BLOCK_BYTES = 1 << 24
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class Line:
    """One `\\n`-terminated line of a text file."""

    number: int
    """1-based line number."""
    start: int
    """Byte offset of its first byte."""
    stop: int
    """Byte offset just past its `\\n` (or the end of the file)."""
    content: bytes
    """Its bytes without the `\\n` and one `\\r` before it."""


@dataclass(frozen=True, slots=True)
class Row:
    """A row that can be embedded."""

    index: int
    """0-based among the input's rows (blank lines are not rows)."""
    line: int | None
    """1-based line number (.txt / .jsonl); None for parquet."""
    text: str
    """The text to embed."""
    row_id: Any = None
    """The --id-field value, if any."""


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row that cannot be embedded: reported and skipped."""

    index: int
    """0-based among the input's rows, as `Row.index`."""
    line: int | None
    """1-based line number (.txt / .jsonl); None for parquet."""
    error: str
    """Why it cannot be embedded."""
    row_id: Any = None
    """The --id-field value, when it could be read."""

    def describe(self) -> str:
        where = f"row {self.index}" if self.line is None else f"line {self.line}, row {self.index}"
        return f"{where}: {self.error}"


AnyRow = Row | BadRow


def iter_lines(stream: BinaryIO, first_number: int = 1, first_byte: int = 0) -> Iterator[Line]:
    """Every line of `stream`, blank ones included, read in blocks."""
    number, offset, tail = first_number, first_byte, b""
    while block := stream.read(_READ_BLOCK_BYTES):
        pieces = (tail + block).split(b"\n")
        tail = pieces.pop()  # an unfinished line (b"" when the block ends with a newline)
        for piece in pieces:
            yield Line(number, offset, offset + len(piece) + 1, _content(piece, offset))
            number, offset = number + 1, offset + len(piece) + 1
    if tail:
        yield Line(number, offset, offset + len(tail), _content(tail, offset))


def _content(piece: bytes, offset: int) -> bytes:
    if offset == 0 and piece.startswith(_BOM):  # a UTF-8 byte-order mark opens the file
        piece = piece[len(_BOM) :]
    return piece[:-1] if piece.endswith(b"\r") else piece


def is_blank(content: bytes) -> bool:
    """Empty or whitespace only, Unicode whitespace included (the module's rule)."""
    if not content.strip():
        return True
    if content.isascii():
        return False
    # Invalid UTF-8 becomes U+FFFD, which is not whitespace: such a line is a (bad) row.
    return not content.decode("utf-8", errors="replace").strip()


def iter_row_lines(stream: BinaryIO, first_number: int = 1, first_byte: int = 0) -> Iterator[Line]:
    """The lines that are rows, in order: the one rule for counting, planning and reading."""
    return (
        line for line in iter_lines(stream, first_number, first_byte) if not is_blank(line.content)
    )


def count_line_rows(stream: BinaryIO) -> int:
    return sum(1 for _ in iter_row_lines(stream))


def parse_line(line: Line, index: int, kind: str, text_field: str, id_field: str | None) -> AnyRow:
    """A .txt (`kind` "txt") or .jsonl ("jsonl") line that is a row → Row or BadRow."""
    try:
        decoded = line.content.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(index, line.number, f"not valid UTF-8 ({e})")
    if kind == "txt":
        return make_row(index, line.number, decoded, None)
    try:
        value = json.loads(decoded)
    except json.JSONDecodeError as e:
        return BadRow(index, line.number, f"not valid JSON ({e})")
    if isinstance(value, str):
        return make_row(index, line.number, value, None)
    if not isinstance(value, dict) or text_field not in value:
        return BadRow(
            index, line.number, f"expected an object with a {text_field!r} field or a string"
        )
    row_id = value.get(id_field) if id_field else None
    return make_row(index, line.number, value[text_field], row_id)


def make_row(index: int, line: int | None, text: Any, row_id: Any) -> AnyRow:
    """Row, or BadRow when `text` is not a non-empty, non-whitespace string of valid Unicode."""
    if not isinstance(text, str) or not text.strip():
        return BadRow(
            index, line, f"the text must be a non-empty string, got {_short(text)}", row_id
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (JSON's "\ud800"): the tokenizer cannot take it.
        return BadRow(index, line, "the text is not valid Unicode (a lone surrogate)", row_id)
    return Row(index, line, text, row_id)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
