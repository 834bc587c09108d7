"""ColBERT (multi-vector) models against a reference written from PyLate's and colbert-ir's
encoding (plain torch + transformers on the same tiny random BERT), in both checkpoint layouts:
token vectors, MaxSim scores, marker tokens, [MASK] query expansion, the punctuation skiplist.

The reference follows pylate/models/colbert.py (tokenize / encode): texts are cut to length - 1
tokens (special tokens included), queries padded with [MASK] to that length, the marker inserted
after [CLS], the body run with its attention mask (zeros on a query's [MASK] expansion when the
model does not attend to it: colbert-ir's attend_to_mask_tokens, PyLate's
attend_to_expansion_tokens), the projection applied, document rows of padding and skiplist
tokens dropped, every row L2-normalized. "colbert_ir_masked_wide" and "pylate_masked" have
32-wide heads, so they run on the CPU attention kernel where that is available (the others,
8-wide, on SDPA); `test_unattended_expansion_on_every_backend` runs them on each backend. When the `pylate` package imports
in a separate venv (it cannot share this one: it pins sentence-transformers 5.3), it is compared
too (`test_matches_pylate_itself`, skipped without that venv).
"""

from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SIZES, copy_bert_tokenizer

QUERY_LENGTH = 16
DOCUMENT_LENGTH = 40
DIM = 16
QUERIES = ["what is a tide pool?", "hi", "Why, exactly, do rerankers re-rank documents?"]
DOCUMENTS = [
    "A tide pool is a rocky pool by the sea, filled at high tide.",
    "Rerankers, cross-encoders and late interaction: three ways to score pairs!",
    "short",
    " ".join(["a long document that is cut to its length"] * 10),
]


WIDE_SIZES = {**TINY_SIZES, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}
"""32-wide heads: the CPU attention kernel's smallest head width."""


def _save_colbert_ir(
    folder: Path, minilm_path: Path, attend: bool, sizes: dict = TINY_SIZES
) -> None:
    """colbert-ir's layout: HF_ColBERT config, bert.* and linear.weight, artifact.metadata."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True)
    copy_bert_tokenizer(minilm_path, folder)
    torch.manual_seed(7)
    config = BertConfig(vocab_size=30522, **sizes)
    body = BertModel(config, add_pooling_layer=False).eval()
    config.architectures = ["HF_ColBERT"]
    config.save_pretrained(str(folder))
    weights = {f"bert.{k}": v.contiguous() for k, v in body.state_dict().items()}
    weights["linear.weight"] = torch.randn(DIM, config.hidden_size) * 0.2
    save_file(weights, str(folder / "model.safetensors"))
    metadata = {
        "query_token_id": "[unused0]",
        "doc_token_id": "[unused1]",
        "query_maxlen": QUERY_LENGTH,
        "doc_maxlen": DOCUMENT_LENGTH,
        "mask_punctuation": True,
        "attend_to_mask_tokens": attend,
        "dim": DIM,
    }
    (folder / "artifact.metadata").write_text(json.dumps(metadata))


def _save_pylate(folder: Path, minilm_path: Path, attend: bool, sizes: dict = TINY_SIZES) -> None:
    """PyLate's layout: a sentence-transformers folder with a Dense projection, "[Q] " / "[D] "
    added to the tokenizer, its fields in config_sentence_transformers.json."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path))
    tokenizer.add_tokens(["[Q] ", "[D] "])
    tokenizer.save_pretrained(str(folder))
    torch.manual_seed(11)
    config = BertConfig(vocab_size=len(tokenizer), **sizes)
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(str(folder))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": QUERY_LENGTH - 1, "do_lower_case": False})
    )
    dense = folder / "1_Dense"
    dense.mkdir()
    (dense / "config.json").write_text(
        json.dumps(
            {
                "in_features": config.hidden_size,
                "out_features": DIM,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    save_file(
        {"linear.weight": torch.randn(DIM, config.hidden_size) * 0.2},
        str(dense / "model.safetensors"),
    )
    st_config = {
        "query_prefix": "[Q] ",
        "document_prefix": "[D] ",
        "query_length": QUERY_LENGTH,
        "document_length": DOCUMENT_LENGTH,
        "attend_to_expansion_tokens": attend,
        "skiplist_words": list(string.punctuation),
        "do_query_expansion": True,
        "prompts": {},
        "default_prompt_name": None,
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))


KINDS = ("colbert_ir", "colbert_ir_masked", "colbert_ir_masked_wide", "pylate", "pylate_masked")
"""The test models: layout, then whether the query expansion is attended to ("_masked": not)."""


@pytest.fixture(scope="session")
def colbert_paths(tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("colbert")
    paths = {kind: root / kind for kind in KINDS}
    _save_colbert_ir(paths["colbert_ir"], minilm_path, attend=True)
    _save_colbert_ir(paths["colbert_ir_masked"], minilm_path, attend=False)
    _save_colbert_ir(paths["colbert_ir_masked_wide"], minilm_path, False, WIDE_SIZES)
    _save_pylate(paths["pylate"], minilm_path, attend=True)
    _save_pylate(paths["pylate_masked"], minilm_path, False, WIDE_SIZES)
    return paths


@pytest.fixture(scope="session")
def colbert_llm(colbert_paths):
    from tidepool import LLM

    cache: dict[str, object] = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = LLM(str(colbert_paths[kind]))
        return cache[kind]

    return get


class Reference:
    """PyLate's ColBERT encoding, re-implemented with transformers (see the module docstring)."""

    def __init__(self, path: Path, kind: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, BertModel

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if kind.startswith("colbert_ir"):
            weights = load_file(str(path / "model.safetensors"))
            self.projection = weights["linear.weight"]
            self.markers = ("[unused0]", "[unused1]")
            metadata = json.loads((path / "artifact.metadata").read_text())
            self.attend = metadata["attend_to_mask_tokens"]
        else:
            self.projection = load_file(str(path / "1_Dense" / "model.safetensors"))[
                "linear.weight"
            ]
            self.markers = ("[Q] ", "[D] ")
            st_config = json.loads((path / "config_sentence_transformers.json").read_text())
            self.attend = st_config["attend_to_expansion_tokens"]
        self.body = BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
        self.skip_ids = set(self.tokenizer.convert_tokens_to_ids(list(string.punctuation)))

    def input_ids(self, texts: list[str], is_query: bool) -> tuple[torch.Tensor, torch.Tensor]:
        length = QUERY_LENGTH if is_query else DOCUMENT_LENGTH
        tok = self.tokenizer
        enc = tok(
            texts,
            truncation=True,
            max_length=length - 1,
            padding="max_length" if is_query else "longest",
            return_tensors="pt",
        )
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if is_query:
            ids = torch.where(mask.bool(), ids, torch.full_like(ids, tok.mask_token_id))
        marker = tok.convert_tokens_to_ids(self.markers[0 if is_query else 1])
        ids = torch.cat([ids[:, :1], torch.full_like(ids[:, :1], marker), ids[:, 1:]], dim=1)
        mask = torch.cat([mask[:, :1], torch.ones_like(mask[:, :1]), mask[:, 1:]], dim=1)
        if is_query and self.attend:
            mask = torch.ones_like(mask)
        return ids, mask

    @torch.no_grad()
    def encode(self, texts: list[str], is_query: bool) -> list[torch.Tensor]:
        ids, mask = self.input_ids(texts, is_query)
        hidden = self.body(input_ids=ids, attention_mask=mask).last_hidden_state
        vectors = hidden @ self.projection.T
        out = []
        for row_ids, row_mask, row in zip(ids, mask, vectors, strict=True):
            if is_query:
                keep = torch.ones_like(row_ids, dtype=torch.bool)
            else:
                skip = torch.tensor([int(t) in self.skip_ids for t in row_ids])
                keep = row_mask.bool() & ~skip
            out.append(F.normalize(row[keep], dim=-1))
        return out


def _maxsim(query: torch.Tensor, document: torch.Tensor) -> float:
    return float((query @ document.T).max(dim=1).values.sum())


def _assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        cos = F.cosine_similarity(a, e, dim=-1)
        assert float(cos.min()) >= 0.99999, float(cos.min())


@pytest.mark.parametrize("kind", KINDS)
def test_vectors_and_maxsim_match_reference(kind, colbert_paths, colbert_llm):
    llm = colbert_llm(kind)
    ref = Reference(colbert_paths[kind], kind)
    assert llm.model_config.multi_vector is not None
    assert llm.model_config.pooling_tasks == ("token_embed",)
    queries = [o.outputs.data for o in llm.encode(QUERIES, prompt_name="query", use_tqdm=False)]
    documents = [o.outputs.data for o in llm.encode(DOCUMENTS, use_tqdm=False)]
    # Guard: different texts give different vectors (a constant output cannot pass).
    assert not torch.allclose(documents[0][:3], documents[1][:3])
    _assert_close(queries, ref.encode(QUERIES, is_query=True))
    _assert_close(documents, ref.encode(DOCUMENTS, is_query=False))
    ref_q, ref_d = ref.encode(QUERIES[:1], True)[0], ref.encode(DOCUMENTS, False)
    scores = llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)
    for out, doc in zip(scores, ref_d, strict=True):
        assert abs(out.outputs.score - _maxsim(ref_q, doc)) < 1e-5


@pytest.mark.parametrize("kind", ["colbert_ir", "pylate"])
def test_marker_expansion_and_skiplist_exact(kind, colbert_paths, colbert_llm):
    llm = colbert_llm(kind)
    ref = Reference(colbert_paths[kind], kind)
    [query] = llm.encode(QUERIES[0], prompt_name="query", use_tqdm=False)
    ids, _ = ref.input_ids(QUERIES[:1], is_query=True)
    assert query.prompt_token_ids == ids[0].tolist()
    assert len(query.prompt_token_ids) == QUERY_LENGTH
    mask_id = ref.tokenizer.mask_token_id
    assert query.prompt_token_ids[-1] == mask_id
    assert query.outputs.data.shape == (QUERY_LENGTH, DIM)
    marker = ref.tokenizer.convert_tokens_to_ids(ref.markers[0])
    assert query.prompt_token_ids[1] == marker
    [doc] = llm.encode(DOCUMENTS[0], prompt_name="document", use_tqdm=False)
    ids, _ = ref.input_ids(DOCUMENTS[:1], is_query=False)
    assert doc.prompt_token_ids == ids[0].tolist()
    num_punct = sum(t in ref.skip_ids for t in doc.prompt_token_ids)
    assert num_punct == 2  # "," and "."
    assert doc.outputs.data.shape == (len(doc.prompt_token_ids) - num_punct, DIM)
    [long_doc] = llm.encode(DOCUMENTS[3], use_tqdm=False)
    assert len(long_doc.prompt_token_ids) == DOCUMENT_LENGTH


def test_unattended_expansion_changes_queries_only(colbert_llm):
    """colbert_ir and colbert_ir_masked share their weights: documents are equal, queries are not
    (the [MASK]s no longer feed the text's vectors), so the key counts take effect."""
    attended, masked = colbert_llm("colbert_ir"), colbert_llm("colbert_ir_masked")
    [q_all] = attended.encode(QUERIES[:1], prompt_name="query", use_tqdm=False)
    [q_text] = masked.encode(QUERIES[:1], prompt_name="query", use_tqdm=False)
    assert q_all.prompt_token_ids == q_text.prompt_token_ids
    cos = F.cosine_similarity(q_all.outputs.data, q_text.outputs.data, dim=-1)
    assert float(cos.min()) < 0.99
    [d_all] = attended.encode(DOCUMENTS[:1], use_tqdm=False)
    [d_text] = masked.encode(DOCUMENTS[:1], use_tqdm=False)
    assert torch.equal(d_all.outputs.data, d_text.outputs.data)


# Lengths near the queries' 16 tokens, so queries and documents share attention buckets.
MIXED_DOCUMENTS = [
    "a tide pool by the sea, a rocky one too",
    "three ways to score pairs of texts, side by side",
]


@pytest.mark.parametrize("kind", ["colbert_ir_masked", "colbert_ir_masked_wide", "pylate_masked"])
def test_unattended_expansion_is_batch_invariant(kind, colbert_llm):
    """Each query alone equals the same query in one step with other queries and documents of
    similar lengths (shared buckets: key counts next to padding)."""
    from tidepool import PoolingParams

    llm = colbert_llm(kind)
    texts = [*QUERIES, *MIXED_DOCUMENTS, *DOCUMENTS]
    roles = ["query"] * len(QUERIES) + ["document"] * (len(texts) - len(QUERIES))
    params = [PoolingParams(prompt_name=role) for role in roles]
    together = llm.encode(texts, pooling_params=params, use_tqdm=False)
    lengths = {len(o.prompt_token_ids) for o in together}
    assert QUERY_LENGTH in lengths and 14 in lengths, lengths  # guard: shared buckets
    assert not torch.allclose(together[0].outputs.data, together[1].outputs.data)
    for text, role, out in zip(texts, roles, together, strict=True):
        [alone] = llm.encode(text, prompt_name=role, use_tqdm=False)
        assert alone.prompt_token_ids == out.prompt_token_ids
        torch.testing.assert_close(out.outputs.data, alone.outputs.data, rtol=0, atol=1e-6)


def test_bad_inputs(colbert_llm, minilm_llm):
    from tidepool.outputs import BatchInputError

    llm = colbert_llm("pylate")
    with pytest.raises(ValueError, match="unknown prompt_name 'passage'.*document, query"):
        llm.encode(QUERIES, prompt_name="passage", use_tqdm=False)
    with pytest.raises(ValueError, match="embed"):
        llm.embed(QUERIES, use_tqdm=False)
    # A bad document fails its pair only; the others are scored.
    with pytest.raises(BatchInputError) as info:
        llm.score(QUERIES[0], [DOCUMENTS[0], "", DOCUMENTS[1]], use_tqdm=False)
    assert [e.index for e in info.value.errors] == [1]
    assert info.value.outputs[0] is not None and info.value.outputs[2] is not None
    # Its score sides are query and document already: other roles are refused.
    with pytest.raises(ValueError, match="scores data_1 as queries"):
        llm.score(QUERIES[0], DOCUMENTS, prompt_name="document", use_tqdm=False)
    # No multi-vector scoring on a dense model: it scores by cosine, and token_embed with a
    # ColBERT prompt name is refused.
    with pytest.raises(ValueError, match="unknown prompt_name 'query'"):
        minilm_llm.encode("x", pooling_task="token_embed", prompt_name="query", use_tqdm=False)


PYLATE_PYTHON = os.environ.get("TIDEPOOL_PYLATE_PYTHON", "/tmp/pylate-venv/bin/python")
"""A Python with pylate installed (it cannot share this venv: it pins sentence-transformers 5.3
and transformers<=5.3): `python3 -m venv /tmp/pylate-venv && /tmp/pylate-venv/bin/pip install
torch==2.13.0 pylate`."""

_PYLATE_SCRIPT = """
import sys, torch
from pylate.models import ColBERT
folder, out, queries, documents = sys.argv[1], sys.argv[2], sys.argv[3:4], sys.argv[4:]
model = ColBERT(folder, device="cpu")
q = model.encode(queries, is_query=True, convert_to_tensor=False)
d = model.encode(documents, is_query=False, convert_to_tensor=False)
torch.save({"queries": [torch.as_tensor(x) for x in q],
            "documents": [torch.as_tensor(x) for x in d]}, out)
"""


@pytest.mark.parametrize("kind", KINDS)
def test_matches_pylate_itself(kind, colbert_paths, colbert_llm, tmp_path):
    if not Path(PYLATE_PYTHON).is_file():
        pytest.skip(
            f"no pylate venv at {PYLATE_PYTHON} (TIDEPOOL_PYLATE_PYTHON): pylate pins "
            "sentence-transformers 5.3 / transformers<=5.3 and cannot be installed here"
        )
    out = tmp_path / "pylate.pt"
    args = [str(colbert_paths[kind]), str(out), QUERIES[0], *DOCUMENTS]
    done = subprocess.run(
        [PYLATE_PYTHON, "-c", _PYLATE_SCRIPT, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = torch.load(out)
    llm = colbert_llm(kind)
    queries = [o.outputs.data for o in llm.encode(QUERIES[:1], prompt_name="query", use_tqdm=False)]
    documents = [o.outputs.data for o in llm.encode(DOCUMENTS, use_tqdm=False)]
    _assert_close(queries, expected["queries"])
    _assert_close(documents, expected["documents"])
    scores = llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)
    for out_score, doc in zip(scores, expected["documents"], strict=True):
        assert abs(out_score.outputs.score - _maxsim(expected["queries"][0], doc)) < 1e-5


def test_server_score_rerank_and_pooling(colbert_paths, colbert_llm):
    """/score, /rerank (v1, v2) score by MaxSim as LLM.score does; /pooling returns the vectors;
    an unknown prompt_name is a 400 naming the model's prompts."""
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    llm = colbert_llm("pylate")
    expected = [o.outputs.score for o in llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)]
    engine = AsyncEngine.from_args(str(colbert_paths["pylate"]), device="cpu", dtype="float32")
    with TestClient(build_app(engine)) as client:
        answer = client.post("/score", json={"text_1": QUERIES[0], "text_2": DOCUMENTS})
        assert answer.status_code == 200, answer.text
        scores = [d["score"] for d in answer.json()["data"]]
        assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) < 1e-5
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            answer = client.post(path, json={"query": QUERIES[0], "documents": DOCUMENTS})
            assert answer.status_code == 200, answer.text
            results = answer.json()["results"]
            assert [r["index"] for r in results] == sorted(
                range(len(DOCUMENTS)), key=lambda i: -expected[i]
            )
        answer = client.post("/pooling", json={"input": QUERIES[0], "prompt_name": "query"})
        assert answer.status_code == 200, answer.text
        [query] = llm.encode(QUERIES[0], prompt_name="query", use_tqdm=False)
        got = torch.tensor(answer.json()["data"][0]["data"])
        _assert_close([got], [query.outputs.data])
        answer = client.post("/pooling", json={"input": "x", "prompt_name": "passage"})
        assert answer.status_code == 400
        assert "document, query" in answer.json()["error"]["message"]
        answer = client.post("/v1/embeddings", json={"input": "x"})
        assert answer.status_code == 400


@pytest.mark.parametrize("kind", ["colbert_ir_masked_wide", "pylate_masked"])
def test_unattended_expansion_on_every_backend(kind, colbert_paths):
    """Key counts reach every encoder attention backend (the CPU kernel, SDPA): queries match the
    reference on each (attend_heads, the transformers backend's entry: test_cpu_attention_kernel)."""
    from tidepool import LLM
    from tidepool.attention import cpu_kernels
    from tidepool.attention.backend import CPU_KERNEL, ENCODER_BACKENDS

    llm = LLM(str(colbert_paths[kind]))
    model = llm.engine.model_runner.model
    chosen = model.attention_backend
    spec = model.attention_spec(torch.device("cpu"), torch.float32)
    runnable = [b for b in ENCODER_BACKENDS.values() if b.supports(spec)]
    if cpu_kernels.supports(torch.device("cpu"), torch.float32, 32):
        assert chosen is CPU_KERNEL and len(runnable) == 2
    expected = Reference(colbert_paths[kind], kind).encode(QUERIES, is_query=True)
    try:
        for backend in runnable:
            model.set_attention_backend(backend)
            got = llm.encode(QUERIES, prompt_name="query", use_tqdm=False)
            _assert_close([o.outputs.data for o in got], expected)
    finally:
        model.set_attention_backend(chosen)


def test_unattended_expansion_refused_where_the_body_cannot_run_it(colbert_paths, tmp_path):
    """DeBERTa's reference zeroes the expansion tokens' embeddings besides masking them as keys
    (its embedding mask), which tidepool's per-sequence key counts do not: refused at load,
    naming the option, instead of vectors that differ from PyLate's."""
    from transformers import DebertaV2Config

    folder = tmp_path / "deberta-colbert"
    shutil.copytree(colbert_paths["pylate_masked"], folder)
    DebertaV2Config(**TINY_SIZES).save_pretrained(str(folder))
    from tidepool import LLM

    with pytest.raises(ValueError, match="attend_to_expansion_tokens"):
        LLM(str(folder))
