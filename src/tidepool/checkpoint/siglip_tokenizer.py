"""SigLIP 1's SentencePiece-only tokenizer as a fast (Rust) tokenizer, built at load.

Hub SigLIP 1 checkpoints (google/siglip-*) ship `spiece.model` and a tokenizer_config.json naming
`SiglipTokenizer`, but no tokenizer.json; transformers' SiglipTokenizer is the slow SentencePiece
backend only, and tidepool's input processor needs a fast tokenizer. `load_tokenizer` builds one
for such a folder, reproducing SiglipTokenizer (transformers 5, tokenization_siglip.py):

    SiglipTokenizer                                  here (a tokenizers.Tokenizer)
    split on its special tokens                      added tokens (not normalized; lstrip and
                                                       rstrip: canonicalize_text strips anyway)
    "▁" in the text → " "                            Replace("▁", " ")
    canonicalize_text: str.lower (do_lower_case)     Replace(final-context Σ → ς), Lowercase,
                                                       with the characters Rust's (newer)
                                                       Unicode lower-cases otherwise escaped
                                                       around it and written as Python does
      string.punctuation removed                     Replace([ASCII punctuation], "")
      re.sub(r"\s+", " "), strip()                  Replace([Python's whitespace]+, " "),
                                                       Strip (right; the left: see below)
    sentencepiece's normalizer: the precompiled      Precompiled(charsmap), Replace(" {2,}", " "),
      charsmap, extra whitespace removed               Strip (right)
    "▁" + text: the first part gets a "▁"; the       Metaspace("▁", prepend_scheme="first"),
      parts after special tokens are encoded as        which prepends to the part at offset 0
      "<unk>" + part with the pieces of "<unk>"        only: a leading run that the steps above
      dropped (a word's continuation, no "▁")          would remove becomes one space instead
                                                       (kept at offset 0, it becomes the "▁")
    Unigram Viterbi, unknown pieces → unk_id,        Unigram(pieces, scores, unk_id): unknown
      consecutive unknowns fused                       characters fused too
    "X </s>" (EOS after each sequence)               TemplateProcessing

Python's final sigma rule (U+03A3 after a cased letter, case-ignorable characters between, and
no cased letter after) is a lookbehind / lookahead regex over Python's own cased and
case-ignorable sets, read off `str.lower` itself; so are the whitespace set, the characters
whose lower case Rust writes otherwise (Unicode 16 letters Python 3.11 leaves as they are), and
the characters the charsmap deletes (for the leading run). Built once per process (~2 s). The
module is checked token for token against SiglipTokenizer in
tests/models/test_siglip_tokenizer.py (a fixed corpus and a hypothesis property test).

Known differences, all on texts that spell special tokens: SiglipTokenizer adds no EOS after a
text ending in a literal "</s>" (this one does: the same ids once padded with "</s>", one more
position in an attention mask); after a literal special token, a part that starts with
punctuation or a control character gets a "▁" here; and sentencepiece never matches its control
pieces ("<pad>", "</s>", "<unk>") in text, which a Unigram model does when NFKC spells one out
of full-width forms ("＜／ｓ＞"; ASCII punctuation itself is removed before NFKC). So a text that
spells one of these pieces, directly or through NFKC, is refused at input, naming the piece
(`spells_special_piece`, which the input processor asks of every text): no guessed ids.

Refused, by name, rather than guessed: a model that is not Unigram, byte fallback, user-defined,
byte or unused pieces, pieces with "▁" inside, no "▁" piece, an empty charsmap, sentencepiece
normalizer options other than the defaults, and any tokenizer_config.json key or value not
handled here (sp_model_kwargs, legacy=False, additional special tokens, split_special_tokens,
...). A `tokenizer=` that is a model id rather than a folder goes to AutoTokenizer as before.
"""

from __future__ import annotations

import functools
import json
import string
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

SPIECE = "spiece.model"
CONFIG = "tokenizer_config.json"
CLASS_NAME = "SiglipTokenizer"
UNDERLINE = "\u2581"
SIGMA = "\u03a3"

# tokenizer_config.json keys this converter reads (or knows to be irrelevant to the ids).
_KNOWN_KEYS = frozenset(
    {
        "tokenizer_class",
        "backend",
        "eos_token",
        "unk_token",
        "pad_token",
        "additional_special_tokens",
        "extra_special_tokens",
        "model_max_length",
        "do_lower_case",
        "sp_model_kwargs",
        "padding_side",
        "truncation_side",
        "model_input_names",
        "clean_up_tokenization_spaces",
        "added_tokens_decoder",
        "processor_class",
        "name_or_path",
        "legacy",
        "split_special_tokens",
    }
)
# Keys whose value must be "empty" (None, {}, [], False) or as stated: (key, allowed values).
_MUST_BE: dict[str, tuple[Any, ...]] = {
    "sp_model_kwargs": (None, {}),
    "additional_special_tokens": (None, []),
    "extra_special_tokens": (None, [], {}),
    "split_special_tokens": (None, False),
    "legacy": (None, True),
    "backend": (None, "sentencepiece"),
}
_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
# sentencepiece_model.proto's ModelProto.SentencePiece.Type and TrainerSpec.ModelType.
_NORMAL, _UNKNOWN, _CONTROL = 1, 2, 3
_PIECE_TYPES = {4: "USER_DEFINED", 5: "UNUSED", 6: "BYTE"}
_UNIGRAM = 1


def needs_conversion(folder: Path) -> bool:
    """True for a SiglipTokenizer folder without tokenizer.json (the one case converted here)."""
    if (folder / "tokenizer.json").is_file() or not (folder / CONFIG).is_file():
        return False
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except ValueError:
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") == CLASS_NAME


def load_tokenizer(source: str) -> Any:
    """The tokenizer at `source` (ModelConfig.tokenizer_source): transformers' AutoTokenizer,
    except for a SentencePiece-only SiglipTokenizer folder, converted here."""
    folder = Path(source)
    if folder.is_dir() and needs_conversion(folder):
        return convert(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


# ----------------------------------------------------------------------------- tokenizer_config


def _token_content(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{CONFIG}: {key}={value!r} is not a token this converter reads")


def _read_config(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    unknown = sorted(set(config) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"{folder / CONFIG}: {', '.join(unknown)} not reproduced by tidepool's "
            f"SiglipTokenizer conversion (the folder has no tokenizer.json)"
        )
    for key, allowed in _MUST_BE.items():
        if key in config and config[key] not in allowed:
            raise ValueError(
                f"{folder / CONFIG}: {key}={config[key]!r} is not reproduced by tidepool's "
                f"SiglipTokenizer conversion (the folder has no tokenizer.json)"
            )
    if not isinstance(config.get("do_lower_case", True), bool):
        raise ValueError(f"{folder / CONFIG}: do_lower_case={config['do_lower_case']!r}")
    return config


def _legacy_files(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The config with special_tokens_map.json merged in, as transformers does: only when the
    config has no added_tokens_decoder (then the map's tokens win; added_tokens.json is read
    then too, and refused here), else both files are ignored."""
    if config.get("added_tokens_decoder"):
        return config
    if (folder / "added_tokens.json").is_file():
        raise ValueError(
            f"{folder}: added_tokens.json is not reproduced by tidepool's SiglipTokenizer "
            f"conversion (the folder has no tokenizer.json)"
        )
    path = folder / "special_tokens_map.json"
    if not path.is_file():
        return config
    tokens = json.loads(path.read_text(encoding="utf-8"))
    unknown = sorted(set(tokens) - {*_DEFAULTS, "additional_special_tokens"})
    if unknown:
        raise ValueError(f"{path}: {', '.join(unknown)} not reproduced by tidepool's conversion")
    if tokens.get("additional_special_tokens"):
        raise ValueError(f"{path}: additional_special_tokens are not reproduced")
    return {**config, **{k: v for k, v in tokens.items() if k in _DEFAULTS}}


def _special_tokens(config: dict[str, Any], pieces: dict[str, int]) -> dict[str, str]:
    """eos / unk / pad contents, each a piece of the sentencepiece model."""
    tokens = {}
    for key, default in _DEFAULTS.items():
        content = _token_content(config.get(key, default), key)
        if content not in pieces:
            raise ValueError(f"{CONFIG}: {key} {content!r} is not a piece of {SPIECE}")
        tokens[key] = content
    return tokens


def _check_added_tokens(
    config: dict[str, Any], special: dict[str, str], pieces: dict[str, int]
) -> None:
    """added_tokens_decoder may only list the special tokens, at their pieces' ids."""
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        content = _token_content(token, f"added_tokens_decoder[{index}]")
        if content not in special.values() or pieces[content] != int(index):
            raise ValueError(
                f"{CONFIG}: added token {content!r} (id {index}) is not reproduced by "
                f"tidepool's SiglipTokenizer conversion (only its special tokens are)"
            )
        flags = {k: v for k, v in token.items() if k in ("normalized", "single_word")}
        if any(flags.values()) or token.get("special") is False:
            raise ValueError(f"{CONFIG}: added token {content!r} with {token} is not reproduced")


# ----------------------------------------------------------------------------- sentencepiece


def _read_proto(path: Path) -> Any:
    from sentencepiece import sentencepiece_model_pb2

    proto: Any = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(path.read_bytes())
    return proto


def _refuse(path: Path, what: str) -> NoReturn:
    raise ValueError(
        f"{path}: {what}, which tidepool's SiglipTokenizer conversion does not reproduce"
    )


def _check_proto(proto: Any, path: Path) -> None:
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != _UNIGRAM:
        _refuse(path, f"model_type {trainer.model_type} (not UNIGRAM)")
    if trainer.byte_fallback:
        _refuse(path, "byte_fallback")
    if trainer.treat_whitespace_as_suffix:
        _refuse(path, "treat_whitespace_as_suffix")
    for option in ("add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces"):
        if not getattr(norm, option):
            _refuse(path, f"normalizer_spec.{option}=false")
    if not norm.precompiled_charsmap:
        _refuse(path, f"an empty precompiled_charsmap (normalizer {norm.name!r})")
    if norm.normalization_rule_tsv:
        _refuse(path, "normalizer_spec.normalization_rule_tsv")
    unknown = [i for i, p in enumerate(proto.pieces) if p.type == _UNKNOWN]
    if unknown != [trainer.unk_id]:
        _refuse(path, f"unknown pieces at {unknown} (unk_id {trainer.unk_id})")
    for piece in proto.pieces:
        if piece.type in _PIECE_TYPES:
            _refuse(path, f"a {_PIECE_TYPES[piece.type]} piece {piece.piece!r}")
        if piece.type == _NORMAL and UNDERLINE in piece.piece[1:]:
            _refuse(path, f"a piece with '{UNDERLINE}' inside ({piece.piece!r})")
    if not any(p.piece == UNDERLINE and p.type == _NORMAL for p in proto.pieces):
        _refuse(path, f"no '{UNDERLINE}' piece")


# ----------------------------------------------------------------------------- Python's rules


def _char_class(codepoints: list[int]) -> str:
    """A regex character class of these code points, as ranges."""
    codepoints = sorted(set(codepoints))
    parts = []
    start = prev = codepoints[0]
    for cp in [*codepoints[1:], -1]:
        if cp == prev + 1:
            prev = cp
            continue
        parts.append(f"\\x{{{start:X}}}" + (f"-\\x{{{prev:X}}}" if prev > start else ""))
        start = prev = cp
    return "[" + "".join(parts) + "]"


def _all_chars() -> list[str]:
    return [chr(cp) for cp in range(sys.maxunicode + 1) if not 0xD800 <= cp <= 0xDFFF]


@functools.lru_cache(maxsize=1)
def python_whitespace() -> str:
    """The characters of Python's `\\s` (str.isspace: also str.strip's set)."""
    return "".join(c for c in _all_chars() if c.isspace())


@functools.lru_cache(maxsize=1)
def _final_sigma_pattern() -> str:
    """Where str.lower writes Σ as ς: a cased letter before (case-ignorable characters between)
    and none after. Both sets read off str.lower: with x case-ignorable, "AxΣ" ends in ς and
    "1xΣ" does not; with x cased (and not case-ignorable), "1xΣ" ends in ς."""
    ignorable, cased = [], []
    for c in _all_chars():
        after_letter = ("A" + c + SIGMA).lower().endswith("ς")
        after_digit = ("1" + c + SIGMA).lower().endswith("ς")
        if after_letter and not after_digit:
            ignorable.append(ord(c))
        elif after_digit:
            cased.append(ord(c))
    ci, cs = _char_class(ignorable), _char_class(cased)
    return f"(?<={cs}{ci}*){SIGMA}(?!{ci}*{cs})"


@functools.lru_cache(maxsize=1)
def lowercase_fixes() -> tuple[tuple[str, str], ...]:
    """(character, str.lower of it) where tokenizers' Lowercase writes another string (Rust's
    Unicode tables are newer than Python's: characters Python does not lower-case yet)."""
    from tokenizers import normalizers

    chars = [c for c in _all_chars() if c not in ("\n", SIGMA, _MARK)]
    rust = normalizers.Lowercase().normalize_str("\n".join(chars)).split("\n")
    if len(rust) != len(chars):
        raise RuntimeError("tokenizers' Lowercase changed the line count: cannot compare")
    return tuple((c, c.lower()) for c, r in zip(chars, rust, strict=True) if r != c.lower())


_MARK = "\uf8ff"
"""A private-use character (no case) that escapes the characters Lowercase must not touch."""


def _lowercase_steps() -> list[Any]:
    """str.lower as normalizers: final sigma; each character Rust lower-cases differently
    escaped to _MARK + a fixed-width number (digits have no case; a _MARK in the text is
    escaped as number 0), Lowercase, then the numbers written back as Python's lower case."""
    from tokenizers import Regex, normalizers

    fixes = lowercase_fixes()
    width = len(str(len(fixes)))
    codes = [f"{_MARK}{i:0{width}d}" for i in range(len(fixes) + 1)]
    steps: list[Any] = [normalizers.Replace(Regex(_final_sigma_pattern()), "ς")]
    if fixes:
        steps.append(normalizers.Replace(_MARK, codes[0]))
        steps += [
            normalizers.Replace(c, code) for (c, _), code in zip(fixes, codes[1:], strict=True)
        ]
    steps.append(normalizers.Lowercase())
    if fixes:
        steps += [
            normalizers.Replace(code, low) for (_, low), code in zip(fixes, codes[1:], strict=True)
        ]
        steps.append(normalizers.Replace(codes[0], _MARK))  # last: it writes _MARKs back
    return steps


# ----------------------------------------------------------------------------- the tokenizer


@functools.lru_cache(maxsize=4)
def _blank_under_charsmap(charsmap: bytes) -> tuple[int, ...]:
    """Code points the charsmap writes as nothing or spaces only (control characters)."""
    from tokenizers import normalizers

    precompiled = normalizers.Precompiled(charsmap)
    return tuple(ord(c) for c in _all_chars() if not precompiled.normalize_str(c).strip(" "))


def _normalizer(charsmap: bytes, lower: bool) -> Any:
    """Per part of the text between special tokens. The first part keeps one leading space
    where SiglipTokenizer's "▁" goes: Metaspace's "first" prepends only to a part whose first
    character is the text's first (offset 0), so a leading run that canonicalize_text or the
    charsmap would remove becomes one space instead (it then becomes the "▁")."""
    from tokenizers import Regex, normalizers

    steps: list[Any] = [normalizers.Replace(UNDERLINE, " ")]
    if lower:
        steps += _lowercase_steps()
    punctuation = [ord(c) for c in string.punctuation]
    whitespace = [ord(c) for c in python_whitespace()]
    leading = _char_class([*punctuation, *whitespace, *_blank_under_charsmap(charsmap)])
    steps += [
        normalizers.Replace(Regex(f"^{leading}+"), " "),
        normalizers.Replace(Regex(_char_class(punctuation)), ""),
        normalizers.Replace(Regex(_char_class(whitespace) + "+"), " "),
        normalizers.Strip(left=False, right=True),
        normalizers.Precompiled(charsmap),
        normalizers.Replace(Regex(" {2,}"), " "),
        normalizers.Strip(left=False, right=True),
    ]
    return normalizers.Sequence(steps)


def _backend(proto: Any, config: dict[str, Any], special: dict[str, str]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = [(p.piece, float(p.score)) for p in proto.pieces]
    tok = Tokenizer(models.Unigram(vocab, proto.trainer_spec.unk_id, False))
    tok.normalizer = _normalizer(
        proto.normalizer_spec.precompiled_charsmap, config.get("do_lower_case", True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(UNDERLINE, prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(UNDERLINE, prepend_scheme="first", split=True)
    # lstrip / rstrip on: whitespace around a special token is stripped by canonicalize_text
    # in SiglipTokenizer whatever its flags say, and the part after one must not start with a
    # space here (it would get a "▁").
    tok.add_special_tokens(
        [
            AddedToken(content, lstrip=True, rstrip=True, normalized=False, special=True)
            for content in dict.fromkeys(special.values())
        ]
    )
    eos = special["eos_token"]
    eos_id = tok.token_to_id(eos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
    )
    return tok


def convert(folder: Path) -> Any:
    """A PreTrainedTokenizerFast equal to SiglipTokenizer on `folder` (spiece.model and
    tokenizer_config.json); refuses what it does not reproduce, naming it."""
    from transformers import PreTrainedTokenizerFast

    config = _legacy_files(folder, _read_config(folder))
    spiece = folder / SPIECE
    if not spiece.is_file():
        raise ValueError(f"{folder}: {CLASS_NAME} without {SPIECE} (nor tokenizer.json)")
    proto = _read_proto(spiece)
    _check_proto(proto, spiece)
    pieces = {p.piece: i for i, p in enumerate(proto.pieces)}
    special = _special_tokens(config, pieces)
    _check_added_tokens(config, special, pieces)
    kwargs: dict[str, Any] = {
        "model_max_length": config.get("model_max_length", 64),
        "padding_side": config.get("padding_side", "right"),
        "truncation_side": config.get("truncation_side", "right"),
        "clean_up_tokenization_spaces": config.get("clean_up_tokenization_spaces", False),
    }
    if "model_input_names" in config:
        kwargs["model_input_names"] = config["model_input_names"]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_backend(proto, config, special),
        name_or_path=str(folder),
        **special,
        **kwargs,
    )
    spelled = {p.piece for p in proto.pieces if p.type in (_UNKNOWN, _CONTROL)}
    spelled |= set(special.values())
    # The input processor asks this of every text (InputProcessor._parse).
    fast.tidepool_text_problem = functools.partial(spells_special_piece, pieces=sorted(spelled))
    return fast


def spells_special_piece(text: str, pieces: Sequence[str]) -> str | None:
    """Why the converted tokenizer may not give SiglipTokenizer's ids for `text`, or None: the
    known differences (module docstring) are all on texts that spell a special or control
    piece, directly or in forms NFKC folds into one, so such a text is refused, not guessed."""
    folded = unicodedata.normalize("NFKC", text) if not text.isascii() else text
    for piece in pieces:
        if piece in text or piece in folded:
            return (
                f"spells the tokenizer's special piece {piece!r}: on such texts tidepool's "
                "conversion of the SentencePiece-only SiglipTokenizer may not give its ids "
                "(checkpoint/siglip_tokenizer.py), so the text is refused; remove the piece"
            )
    return None


__all__ = ["convert", "load_tokenizer", "needs_conversion", "spells_special_piece"]
