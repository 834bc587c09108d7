"""The default max_model_len follows the reference's truncation length.

sentence-transformers truncates a plain transformers folder (no modules.json) at
min(max_position_embeddings, the tokenizer's model_max_length); tidepool's default max_model_len
for a plain bidirectional encoder is that same length, so a pair the reference would cut is
refused (or cut the same way with truncate_prompt_tokens) instead of scored past the
reference's length (issue 24: DeBERTa cross-encoders equal below ~128 tokens, off by up to 0.2
above, with a tokenizer saying 128).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.tolerances import assert_close
from tidepool import LLM

CAP = 40


@pytest.fixture(scope="module")
def capped_cross_encoder(tiny_model_path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("capped") / "model"
    shutil.copytree(tiny_model_path("bert-cross-encoder"), folder)
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["model_max_length"] = CAP
    tokenizer_config.write_text(json.dumps(settings))
    return folder


def test_plain_encoder_takes_the_tokenizers_length(capped_cross_encoder: Path) -> None:
    llm = LLM(str(capped_cross_encoder))
    assert llm.model_config.max_model_len == CAP
    # An explicit max_model_len may go past it, up to the positions' limit.
    assert LLM(str(capped_cross_encoder), max_model_len=64).model_config.max_model_len == 64


def test_long_pairs_are_refused_or_cut_as_the_reference_cuts(capped_cross_encoder: Path) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(capped_cross_encoder), device="cpu")
    assert reference.max_length == CAP
    query = "what lives in a tide pool"
    short = "crabs and anemones"
    long = " ".join(["starfish and mussels cling to the rocks"] * 12)  # ~90 tokens
    llm = LLM(str(capped_cross_encoder))
    (ok,) = llm.score(query, [short])
    expected = reference.predict([(query, short)], activation_fn=None, convert_to_numpy=True)
    assert_close(ok.outputs.score, float(expected[0]), depth=3, reduction=32)
    with pytest.raises(ValueError, match=str(CAP)):
        llm.score(query, [long])
    (cut,) = llm.score(query, [long], truncate_prompt_tokens=CAP)
    expected = reference.predict([(query, long)], activation_fn=None, convert_to_numpy=True)
    assert_close(cut.outputs.score, float(expected[0]), depth=3, reduction=32)
