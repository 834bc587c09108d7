"""CLIP text towers on the transformers backend (and the fallback), float32 on CPU.

References: transformers run directly on the token ids tidepool used, one text at a time:
`CLIPTextModelWithProjection(...).text_embeds` and `CLIPTextModel(...).pooler_output` (the EOS
token's state; sentence-transformers' CLIP module computes the same through get_text_features).
sentence-transformers loads a text-only CLIP folder as CLIPTextModel (AutoModel) and drops
text_projection, so it is the reference where the folder's modules.json names a Pooling (MEAN).

The tiny towers keep CLIP's 77 positions; every call packs texts of <= 77 tokens whose total is
over 77 (the packed step once failed: "Sequence length must be less than max_position_embeddings").
The layers are causal only through the `is_causal=True` CLIPTextModel passes at call time (each
CLIPAttention says is_causal=False). The tokenizer is a byte-level BPE with CLIP's
<|startoftext|> / <|endoftext|> around every text.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_TEXTS
from st_metadata import write_st_metadata
from tolerances import assert_close, assert_cosine_close

from tidepool import LLM, PoolingParams
from tidepool.transformers_backend import attention as transformers_attention

RAW = PoolingParams(normalize=False)
SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|pad|>"]  # ids 0, 1, 2
MAX_POSITIONS = 77
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=MAX_POSITIONS,
    projection_dim=32,
    initializer_factor=5.0,  # attention far from uniform: a dropped causal mask shows
)
# Texts of 3 to 60 tokens; an EOS inside a text (transformers pools the first one).
TEXTS = [
    *TINY_TEXTS[:6],
    "a photo <|endoftext|> of a cat",
    " ".join(["embeddings rerankers and classifiers share one encoder"] * 3),
    *TINY_TEXTS[7:9],
]
# arch, config extras: eos_token_id 1 (the tokenizer's EOS: its first position), the legacy
# eos_token_id 2 (transformers then pools the largest id's first position).
KINDS = {
    "projection": ("CLIPTextModelWithProjection", {"eos_token_id": 1}),
    "text": ("CLIPTextModel", {"eos_token_id": 1}),
    "projection-legacy-eos": ("CLIPTextModelWithProjection", {"eos_token_id": 2}),
}


def save_clip_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL[0],
        eos_token=SPECIAL[1],
        pad_token=SPECIAL[2],
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(folder))
    return len(fast)


@pytest.fixture(scope="module")
def clip_tiny(tmp_path_factory):
    """kind → (folder, the transformers model saved there, in eval mode)."""
    root = tmp_path_factory.mktemp("clip_text")
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            arch, extra = KINDS[kind]
            folder = root / kind
            folder.mkdir()
            vocab = save_clip_tokenizer(folder)
            config = transformers.CLIPTextConfig(
                vocab_size=vocab, bos_token_id=0, pad_token_id=2, **SIZES, **extra
            )
            torch.manual_seed(70 + list(KINDS).index(kind))
            model = getattr(transformers, arch)(config).eval()
            model.save_pretrained(str(folder))
            built[kind] = (folder, model)
        return built[kind]

    return get


def _embed(llm: LLM, texts: list[str]):
    outs = llm.embed(texts, pooling_params=RAW, use_tqdm=False)
    return outs, torch.tensor([o.outputs.embedding for o in outs])


@torch.inference_mode()
def _reference(model: torch.nn.Module, ids_list: list[list[int]]) -> torch.Tensor:
    rows = []
    for ids in ids_list:
        out = model(input_ids=torch.tensor([ids]))
        rows.append(out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output)
    return torch.cat(rows)


DEPTH = SIZES["num_hidden_layers"] + 2  # + embeddings, + the projection
REDUCTION = SIZES["intermediate_size"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_clip_text_tower_matches_transformers(kind, clip_tiny, report_tolerance):
    folder, hf = clip_tiny(kind)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "transformers"
    outs, got = _embed(llm, TEXTS)
    lens = [len(o.prompt_token_ids) for o in outs]
    assert max(lens) <= MAX_POSITIONS < sum(lens)  # one packed step over the position table
    expected = _reference(hf, [o.prompt_token_ids for o in outs])
    width = SIZES["projection_dim"] if kind.startswith("projection") else SIZES["hidden_size"]
    assert got.shape == expected.shape == (len(TEXTS), width)
    report_tolerance(f"backend tiny clip {kind} embed", got, expected)
    assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION, msg=kind)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION, msg=kind)
    # Alone equals packed; the causal mask matters (the EOS row sees every earlier token).
    alone = torch.cat([_embed(llm, [t])[1] for t in TEXTS[:3]])
    assert_close(alone, got[:3], depth=DEPTH, reduction=REDUCTION, msg=f"{kind} alone")
    # The EOS inside TEXTS[6]: transformers pools its first EOS (or, legacy, largest id).
    ids = outs[6].prompt_token_ids
    assert ids.count(1) == 2


def test_clip_text_token_states_are_causal(clip_tiny):
    """Every token's state equals transformers' last_hidden_state: each sees only its past.
    One text per call (under 77 tokens): the causal mask alone decides."""
    folder, hf = clip_tiny("text")
    llm = LLM(str(folder), device="cpu", dtype="float32")
    for text in TEXTS:
        (out,) = llm.encode([text], RAW, pooling_task="token_embed", use_tqdm=False)
        with torch.inference_mode():
            expected = hf(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        assert_close(out.outputs.data, expected, depth=DEPTH, reduction=REDUCTION, msg=text)


@pytest.mark.parametrize("kind", ["projection", "text"])
def test_clip_text_with_st_pooling_matches_sentence_transformers(kind, clip_tiny, tmp_path):
    """modules.json names MEAN pooling: the Pooling module's pooling of the hidden states, as
    sentence-transformers computes it (it loads the tower as CLIPTextModel, no projection)."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / kind
    shutil.copytree(clip_tiny(kind)[0], folder)
    write_st_metadata(
        folder, {"word_embedding_dimension": SIZES["hidden_size"], "pooling_mode": "mean"}
    )
    expected = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(TEXTS))
    llm = LLM(str(folder), device="cpu", dtype="float32")
    _, got = _embed(llm, TEXTS)
    assert got.shape == expected.shape == (len(TEXTS), SIZES["hidden_size"])
    assert_cosine_close(got, expected, depth=DEPTH, reduction=REDUCTION)
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION)


def _ignore_causal(monkeypatch) -> None:
    """A backend that drops the call's is_causal (what it did before it was honoured)."""
    attend = transformers_attention.EncoderStep.attend

    def bidirectional(self, module, query, key, value, scale, window, *rest):
        return attend(self, module, query, key, value, scale, window, False)

    monkeypatch.setattr(transformers_attention.EncoderStep, "attend", bidirectional)


def test_load_check_moves_a_wrong_backend_to_the_fallback(clip_tiny, monkeypatch, caplog):
    """The backend's load-time check (transformers_backend/check.py) catches a mask it drops:
    auto runs the tower on the fallback, with one line saying why, and the numbers stay
    transformers'; model_impl="transformers" refuses it."""
    from tidepool.transformers_backend.fallback import BackendDisagreementError

    folder, hf = clip_tiny("projection")
    _ignore_causal(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "fallback"
    warnings = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "CLIPTextModelWithProjection" in warnings[0]
    assert "disagrees with transformers' own attention" in warnings[0]
    outs, got = _embed(llm, TEXTS)
    expected = _reference(hf, [o.prompt_token_ids for o in outs])
    assert_close(got, expected, depth=DEPTH, reduction=REDUCTION, msg="fallback")
    with pytest.raises(BackendDisagreementError, match="disagrees with transformers' own"):
        LLM(str(folder), device="cpu", dtype="float32", model_impl="transformers")
