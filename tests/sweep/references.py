"""What both sides get (inputs), how each reference computes, how tidepool is asked, and the bounds.

Inputs. Token-id prompts (`{"prompt_token_ids": ids}`: no tokenizer between the two sides) of
every length from 1 token to max_model_len: 1, 2, 3, around the CPU kernel's tiles (8 query rows,
16 / 32 keys), half and all of max_model_len; ids drawn with the model's seed from the ordinary
vocabulary (no specials in the middle: RoBERTa numbers positions from the pad id, CLIP pools at the
first EOS), wrapped in the tokenizer's BOS / EOS. Text inputs (cross-encoder pairs, BGE-M3, LLM
rerankers) are made of words that are one token each, so their lengths span the same range.
tidepool runs them packed (one call: the total is several times max_model_len, so a per-sequence
limit checked against the packed length fails) and one at a time; the reference runs each alone
(batch of one: no padding in the reference).

Bounds. float32: tests/tolerances.py (unit roundoff, depth, the longest reduction, relative to the
row's magnitude). bfloat16 (documented, looser): every reduction's result is rounded to bfloat16
(u = 2**-8) and oneDNN accumulates in float32, so the norm-wise relative error of a layer's output
is at most ~REDUCTIONS_PER_LAYER * u, adding up linearly over the layers, and both sides' errors add
when the reference is float32: 2 * 8 * depth * 2**-8 (0.19 for depth 3; a cosine of >= 0.98).
int8 (documented in docs/quantization.md and the int8 tests): per-token dynamic int8 keeps pooled
vectors at cosine >= 0.99 of float32 and scores within 2% of their scale; for per-token outputs
the bound applies to each sequence's mean-pooled vector (a single token of a random tiny model
may sit further off). An int8 case also checks that int8 ran (the load check may keep float32).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from tolerances import REDUCTIONS_PER_LAYER, approx, assert_close

from sweep.grid import Case, Model

# tokenizer kind → (BOS, EOS, first ordinary id)
SPECIALS: dict[str, tuple[int | None, int | None, int]] = {
    "bert": (101, 102, 1000),
    "bpe": (0, 2, 5),
    "unigram": (0, 2, 5),
    "decoder": (1, None, 6),
    "t5": (None, 1, 3),
    "reranker": (None, None, 5),
}
BF16_UNIT_ROUNDOFF = 2.0**-8
INT8_MIN_COSINE = 0.99
INT8_SCORE_REL = 0.02


def lengths(max_len: int) -> list[int]:
    wanted = {1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, max_len // 2, max_len - 1, max_len}
    return sorted(n for n in wanted if 1 <= n <= max_len)


def token_inputs(model: Model, vocab_size: int, max_len: int) -> list[list[int]]:
    """One sequence per length (see the module docstring)."""
    bos, eos, first = SPECIALS[model.tokenizer]
    rng = random.Random(model.seed)
    seqs = []
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    for n in lengths(max_len):
        if n <= len(head) + len(tail):
            seqs.append((head + tail)[:n])
            continue
        body = [rng.randrange(first, vocab_size) for _ in range(n - len(head) - len(tail))]
        seqs.append(head + body + tail)
    for ids, n in zip(seqs, lengths(max_len), strict=True):
        assert len(ids) == n, (ids, n)
    return seqs


def one_token_words(tokenizer, count: int = 400) -> list[str]:
    """Words the tokenizer keeps as one token each, also inside a sentence."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    words = []
    for token, _ in vocab:
        word = tokenizer.convert_tokens_to_string([token]).strip()
        if not (word.isalnum() and word == word.lower() and len(word) >= 2):
            continue
        if len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1:
            words.append(word)
    words = sorted(set(words))
    text = " " + " ".join(words[:50])
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == min(50, len(words))
    assert len(words) >= 20, f"only {len(words)} one-token words"
    return words[:count]


def text_pairs(tokenizer, seed: int, max_len: int) -> list[tuple[str, str]]:
    """(query, document) pairs whose pair encodings run from a few tokens to max_len."""
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    pairs = []
    for total in lengths(max_len)[2:]:
        n_query = max(1, total // 4)
        query = " ".join(rng.choice(words) for _ in range(n_query))
        doc_words = [rng.choice(words) for _ in range(max(1, total - n_query))]
        while len(doc_words) > 1 and _pair_len(tokenizer, query, doc_words) > total:
            doc_words.pop()
        pairs.append((query, " ".join(doc_words)))
    assert max(_pair_len(tokenizer, q, d.split()) for q, d in pairs) <= max_len
    return pairs


def _pair_len(tokenizer, query: str, doc_words: list[str]) -> int:
    return len(tokenizer(query, " ".join(doc_words))["input_ids"])


# ----------------------------------------------------------------------------- references


def _hf_model(model: Model, folder: Path, hf_folder: Path | None = None):
    cls = getattr(transformers, model.hf_class)
    return cls.from_pretrained(str(hf_folder or folder), dtype=torch.float32).eval()


def _body(hf: torch.nn.Module, model: Model) -> torch.nn.Module:
    """The base model of a checkpoint with a head (last_hidden_state is what tidepool pools)."""
    if "For" in model.hf_class:
        return hf.base_model
    return hf


@torch.inference_mode()
def ref_tokens(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    body = _body(_hf_model(model, folder), model)
    return [body(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in seqs]


@torch.inference_mode()
def ref_st(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu").eval()
    out = []
    for ids in seqs:
        features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}
        out.append(st(features)["sentence_embedding"][0])
    return out


@torch.inference_mode()
def ref_classify(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    hf = _hf_model(model, folder)
    return [hf(input_ids=torch.tensor([ids])).logits[0] for ids in seqs]


@torch.inference_mode()
def ref_token_classify(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    hf = _hf_model(model, folder)
    return [hf(input_ids=torch.tensor([ids])).logits[0] for ids in seqs]


@torch.inference_mode()
def ref_splade(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(str(folder), device="cpu").eval()
    out = []
    for ids in seqs:
        features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}
        out.append(encoder(features)["sentence_embedding"][0].to_dense())
    return out


@torch.inference_mode()
def ref_clip_embed(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    hf = _hf_model(model, folder)
    return [hf(input_ids=torch.tensor([ids])).text_embeds[0] for ids in seqs]


def ref_cross_encoder(model: Model, folder: Path, pairs: list[tuple[str, str]]) -> list[float]:
    from sentence_transformers import CrossEncoder

    scores = CrossEncoder(str(folder), device="cpu").predict(pairs, batch_size=1)
    return [float(s) for s in scores]


def _flag_model_cls():
    """FlagEmbedding's BGEM3FlagModel (its package imports a transformers 4 module it never uses
    for BGE-M3: an empty stand-in lets the import through; as tests/models/test_bge_m3.py)."""
    import sys
    import types

    name = "transformers.modeling_attn_mask_utils"
    if name not in sys.modules:
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)

            def _unavailable(*args, **kwargs):
                raise RuntimeError(f"{name} is stubbed for the sweep")

            def _attribute(attr: str):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _unavailable

            stub.__getattr__ = _attribute  # type: ignore[method-assign]
            sys.modules[name] = stub
    import FlagEmbedding

    return FlagEmbedding.BGEM3FlagModel


def ref_bge_m3(model: Model, folder: Path, texts: list[str]) -> dict[str, Any]:
    flag = _flag_model_cls()(str(folder), use_fp16=False, devices="cpu")
    out = flag.encode(texts, return_dense=True, return_sparse=True, batch_size=1)
    return {"dense": torch.from_numpy(out["dense_vecs"]).float(), "sparse": out["lexical_weights"]}


QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def vllm_reranker_texts(tokenizer, seed: int, max_len: int) -> tuple[list[str], list[str]]:
    """Queries and documents pre-formatted as vLLM's Qwen3-Reranker example does."""
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    queries, docs = [], []
    for n in (1, 3, 8, 20):
        query = " ".join(rng.choice(words) for _ in range(max(1, n // 2)))
        doc = " ".join(rng.choice(words) for _ in range(n))
        q = f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {query}\n"
        d = f"<Document>: {doc}{QWEN3_SUFFIX}"
        if _concat_len(tokenizer, q, d) <= max_len:
            queries.append(q)
            docs.append(d)
    assert len(queries) >= 2
    return queries, docs


def _concat_len(tokenizer, q: str, d: str) -> int:
    return len(tokenizer(q, add_special_tokens=False)["input_ids"]) + len(
        tokenizer(d, add_special_tokens=False)["input_ids"]
    )


@torch.inference_mode()
def ref_rerank_vllm(model: Model, folder: Path, texts: tuple[list[str], list[str]]) -> list[float]:
    """vLLM: the pair is the query's tokens then the document's (no template of its own), the
    score sigmoid(logit[yes] - logit[no]) of the causal LM at the last token."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    lm = _hf_model(model, folder)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    scores = []
    for q, d in zip(*texts, strict=True):
        ids = (
            tok(q, add_special_tokens=False)["input_ids"]
            + tok(d, add_special_tokens=False)["input_ids"]
        )
        logits = lm(torch.tensor([ids])).logits[0, -1]
        scores.append(float(torch.sigmoid(logits[yes] - logits[no])))
    return scores


@torch.inference_mode()
def ref_colbert(model: Model, folder: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """colbert-ir's document vectors (vLLM's ColBERT formula): every token's hidden state through
    `linear`, L2-normalized, punctuation tokens dropped (colbert-ir's mask_punctuation)."""
    import string

    from safetensors.torch import load_file

    body = transformers.BertModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    linear = load_file(str(folder / "model.safetensors"))["linear.weight"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    skip = set(tokenizer.convert_tokens_to_ids(list(string.punctuation)))
    out = []
    for ids in seqs:
        hidden = body(input_ids=torch.tensor([ids])).last_hidden_state[0]
        keep = torch.tensor([i not in skip for i in ids])
        out.append(F.normalize(hidden[keep] @ linear.t(), dim=-1))
    return out


REFERENCES: dict[str, Callable[..., Any]] = {
    "colbert": ref_colbert,
    "tokens": ref_tokens,
    "st": ref_st,
    "classify": ref_classify,
    "token_classify": ref_token_classify,
    "splade": ref_splade,
    "clip_embed": ref_clip_embed,
    "cross_encoder": ref_cross_encoder,
    "bge_m3": ref_bge_m3,
    "rerank_vllm": ref_rerank_vllm,
}
TEXT_OUTPUTS = ("cross_encoder", "bge_m3", "rerank_vllm")


# ----------------------------------------------------------------------------- tidepool


def _prompts(seqs: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": ids} for ids in seqs]


def run_tidepool(llm, output: str, inputs: Any) -> list[Any]:
    """tidepool's answer for `inputs` (token-id sequences, or texts for TEXT_OUTPUTS)."""
    from tidepool import PoolingParams

    raw = PoolingParams(normalize=False, activation=False)
    if output == "tokens":
        outs = llm.encode(
            _prompts(inputs),
            PoolingParams(normalize=False),
            pooling_task="token_embed",
            use_tqdm=False,
        )
        return [o.outputs.data for o in outs]
    if output == "colbert":
        outs = llm.encode(_prompts(inputs), pooling_task="token_embed", use_tqdm=False)
        return [o.outputs.data for o in outs]
    if output in ("st",):
        return [
            torch.tensor(o.outputs.embedding) for o in llm.embed(_prompts(inputs), use_tqdm=False)
        ]
    if output == "clip_embed":
        outs = llm.embed(
            _prompts(inputs), pooling_params=PoolingParams(normalize=False), use_tqdm=False
        )
        return [torch.tensor(o.outputs.embedding) for o in outs]
    if output == "classify":
        outs = llm.encode(
            _prompts(inputs),
            PoolingParams(activation=False),
            pooling_task="classify",
            use_tqdm=False,
        )
        return [o.outputs.data for o in outs]
    if output == "token_classify":
        outs = llm.encode(
            _prompts(inputs),
            PoolingParams(activation=False),
            pooling_task="token_classify",
            use_tqdm=False,
        )
        return [o.outputs.data for o in outs]
    if output == "splade":
        outs = llm.encode(_prompts(inputs), pooling_task="embed_sparse", use_tqdm=False)
        return [o.outputs.data.to_dense() for o in outs]
    if output == "cross_encoder":
        queries, docs = zip(*inputs, strict=True)
        return [o.outputs.score for o in llm.score(list(queries), list(docs), use_tqdm=False)]
    if output == "rerank_vllm":
        queries, docs = inputs
        return [o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)]
    if output == "bge_m3":
        dense = [o.outputs.data for o in llm.encode(inputs, pooling_task="embed", use_tqdm=False)]
        sparse = llm.encode(inputs, pooling_task="embed_sparse", use_tqdm=False)
        return [dense, [o.outputs.data.to_dense() for o in sparse]]
    del raw
    raise ValueError(f"unknown output {output!r}")


def run_alone(llm, output: str, inputs: Any) -> list[Any]:
    """The same inputs one call each (no packing with other sequences)."""
    if output == "bge_m3":
        parts = [run_tidepool(llm, output, [text]) for text in inputs]
        return [[p[0][0] for p in parts], [p[1][0] for p in parts]]
    if output == "rerank_vllm":
        return [run_tidepool(llm, output, ([q], [d]))[0] for q, d in zip(*inputs, strict=True)]
    return [run_tidepool(llm, output, [item])[0] for item in inputs]


# ----------------------------------------------------------------------------- bounds


@dataclass(frozen=True)
class Bound:
    kind: str
    """float32 (tests/tolerances.py), bfloat16 or int8 (module docstring)."""
    depth: int
    reduction: int

    @classmethod
    def of(cls, case: Case, max_len: int) -> Bound:
        kind = "int8" if case.quantization == "int8" else case.dtype
        extra = 1 if case.output in ("st", "cross_encoder", "classify", "splade", "bge_m3") else 0
        return cls(kind, case.model.depth + extra, max(case.model.widest, max_len))

    def check_rows(self, got: torch.Tensor, ref: torch.Tensor, msg: str) -> float:
        """One sequence's output ([L, d] rows or a [d] vector) against its reference."""
        got, ref = got.double().reshape(-1, ref.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
        if self.kind == "int8":  # the int8 bound is on pooled vectors (the module docstring)
            got, ref = got.mean(0, keepdim=True), ref.mean(0, keepdim=True)
        assert got.shape == ref.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        if self.kind == "float32":
            return assert_close(
                got, ref, depth=self.depth, reduction=self.reduction, dim=-1, msg=msg
            )
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
        limit = (
            2 * REDUCTIONS_PER_LAYER * self.depth * BF16_UNIT_ROUNDOFF
            if self.kind == "bfloat16"
            else math.sqrt(2 * (1 - INT8_MIN_COSINE))
        )
        worst = float(rel.max())
        assert worst <= limit, (
            f"{msg}: norm-wise relative error {worst:.3e} > {self.kind} bound {limit:.3e}"
        )
        return worst / limit

    def check_scores(self, got: list[float], ref: list[float], msg: str) -> None:
        if self.kind == "float32":
            assert got == approx(ref, depth=self.depth, reduction=self.reduction), msg
            return
        scale = max(1.0, max(abs(r) for r in ref))
        rel = (
            INT8_SCORE_REL
            if self.kind == "int8"
            else 2 * REDUCTIONS_PER_LAYER * self.depth * BF16_UNIT_ROUNDOFF
        )
        worst = max(abs(g - r) for g, r in zip(got, ref, strict=True))
        assert worst <= rel * scale, f"{msg}: {worst:.3e} > {rel * scale:.3e}"


def check(case: Case, bound: Bound, got: list[Any], ref: Any, what: str) -> None:
    """tidepool's outputs (`what`: packed or alone) against the reference, sequence by sequence."""
    if case.output in ("cross_encoder", "rerank_vllm"):
        bound.check_scores([float(g) for g in got], [float(r) for r in ref], f"{case.id} {what}")
        return
    if case.output == "bge_m3":
        dense, sparse = got
        for i, (g, r) in enumerate(zip(dense, ref["dense"], strict=True)):
            bound.check_rows(g, r, f"{case.id} {what} dense #{i}")
        for i, (g, weights) in enumerate(zip(sparse, ref["sparse"], strict=True)):
            expected = torch.zeros_like(g)
            for token, w in weights.items():
                expected[int(token)] = float(w)
            bound.check_rows(g, expected, f"{case.id} {what} sparse #{i}")
        return
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        bound.check_rows(g, r, f"{case.id} {what} #{i} (len {r.shape[0] if r.dim() > 1 else '-'})")


def guard(case: Case, ref: Any) -> None:
    """The outputs differ from each other (a model answering one constant would pass nothing)."""
    if case.output in ("cross_encoder", "rerank_vllm"):
        assert len({round(float(r), 5) for r in ref}) > 1, f"{case.id}: constant reference scores"
    elif case.output == "bge_m3":
        assert F.cosine_similarity(ref["dense"][:1], ref["dense"][1:]).max() < 0.9999
    else:
        lasts = torch.stack([r.reshape(-1, r.shape[-1])[-1] for r in ref]).double()
        if lasts.shape[-1] == 1:  # one logit per sequence
            assert len({round(float(v), 5) for v in lasts[:, 0]}) > 1, f"{case.id}: constant"
        else:
            cos = F.cosine_similarity(lasts[:1], lasts[1:]).max()
            assert cos < 0.9999, f"{case.id}: constant outputs"
