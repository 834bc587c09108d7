"""LLM rerankers: a tiny random Qwen3ForCausalLM read as a cross-encoder from its "no" / "yes"
LM-head rows (vLLM's hf_overrides), its converted seq-cls form, and causal checkpoints that ship a
classification head (convert="classify"), against transformers; vLLM's documented usage (texts the
user formatted, read as their plain concatenation); the built-in template when asked for; the
routes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tidepool import LLM
from tidepool.engine.score_template import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_TEMPLATE,
    ScoreTemplate,
)
from tidepool.outputs import BatchInputError

QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
QUERY = "what is the capital of france?"
# vLLM's Qwen3-Reranker example (examples/offline_inference/qwen3_reranker.py): the user formats
# the query and each document; vLLM scores the concatenation query + document.
VLLM_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
VLLM_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DOCS = [
    "Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog.",
    "Berlin is the capital of Germany.",
    "France is a country in Western Europe, its capital is Paris.",
    "hi",
]
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=2,
)


def save_reranker_tokenizer(folder: Path) -> int:
    """A byte-level BPE (no BOS, as Qwen's) whose vocabulary has "yes" and "no" as tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [QWEN3_RERANKER_TEMPLATE, QWEN3_RERANKER_INSTRUCTION, QUERY, *DOCS] + [
        "yes\nno\n"
    ] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    return len(fast)


@pytest.fixture(scope="module")
def reranker_dirs(tmp_path_factory) -> dict[str, Path]:
    """ "original": a Qwen3ForCausalLM; "seq_cls": the same weights as Qwen3ForSequenceClassification
    with score.weight = lm_head[yes] - lm_head[no]; "qwen2_cls": a Qwen2ForSequenceClassification
    with 3 labels; "qwen2_cls_as_lm": that checkpoint with config.json saying Qwen2ForCausalLM."""
    import transformers

    root = tmp_path_factory.mktemp("llm_rerankers")
    dirs = {name: root / name for name in ("original", "seq_cls", "qwen2_cls", "qwen2_cls_as_lm")}
    vocab_size = 0
    for folder in dirs.values():
        folder.mkdir()
        vocab_size = save_reranker_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=vocab_size, **SIZES)
    lm = transformers.Qwen3ForCausalLM(config).eval()
    lm.save_pretrained(str(dirs["original"]))
    tok = transformers.AutoTokenizer.from_pretrained(str(dirs["original"]))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    seq_cls = transformers.Qwen3ForSequenceClassification(
        transformers.Qwen3Config(vocab_size=vocab_size, num_labels=1, **SIZES)
    ).eval()
    seq_cls.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        seq_cls.score.weight.copy_(lm.lm_head.weight[yes] - lm.lm_head.weight[no])
    seq_cls.save_pretrained(str(dirs["seq_cls"]))
    torch.manual_seed(1)
    qwen2 = transformers.Qwen2ForSequenceClassification(
        transformers.Qwen2Config(
            vocab_size=vocab_size,
            num_labels=3,
            **{k: v for k, v in SIZES.items() if k != "head_dim"},
        )
    ).eval()
    for name in ("qwen2_cls", "qwen2_cls_as_lm"):
        qwen2.save_pretrained(str(dirs[name]))
    config_file = dirs["qwen2_cls_as_lm"] / "config.json"
    raw = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**raw, "architectures": ["Qwen2ForCausalLM"]}))
    return dirs


@pytest.fixture(scope="module")
def reranker(reranker_dirs) -> LLM:
    """vLLM's documented usage: the hf_overrides and nothing else (no template)."""
    return LLM(
        str(reranker_dirs["original"]), hf_overrides=QWEN3_RERANKER, device="cpu", dtype="float32"
    )


@pytest.fixture(scope="module")
def templated(reranker_dirs) -> LLM:
    """The built-in Qwen3-Reranker template, asked for: tidepool formats plain texts."""
    return LLM(
        str(reranker_dirs["original"]),
        hf_overrides=QWEN3_RERANKER,
        score_template="qwen3_reranker",
        device="cpu",
        dtype="float32",
    )


def vllm_query(query: str, instruction: str = QWEN3_RERANKER_INSTRUCTION) -> str:
    return f"{VLLM_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n"


def vllm_document(doc: str) -> str:
    return f"<Document>: {doc}{VLLM_SUFFIX}"


def yes_no_scores(folder: Path, prompts: list[str]) -> list[float]:
    """transformers: sigmoid(logit_yes - logit_no) at the last token of each prompt, tokenized as
    one text (what vLLM equals)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    scores = []
    with torch.no_grad():
        for prompt in prompts:
            logits = lm(tok(prompt, return_tensors="pt").input_ids).logits[0, -1]
            scores.append(float(torch.sigmoid(logits[yes] - logits[no])))
    return scores


def reference_scores(folder: Path, query: str, docs: list[str], instruction: str) -> list[float]:
    """transformers on each pair rendered into the Qwen3-Reranker template (the model card's
    recipe), sigmoid(yes - no)."""
    template = ScoreTemplate.parse(QWEN3_RERANKER_TEMPLATE.replace("{instruction}", instruction))
    return yes_no_scores(folder, [template.render(query, doc) for doc in docs])


def scores_of(llm: LLM, query, docs) -> list[float]:
    return [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]


def test_vllm_documented_usage_matches_transformers(reranker, reranker_dirs) -> None:
    """vLLM's example as written (pre-formatted queries and documents, N-to-N and 1-to-N): each
    score is sigmoid(logit_yes - logit_no) of transformers on query + document, which is what
    vLLM 0.32 gives. A second template around the texts moves the scores by up to ~0.3."""
    queries = [vllm_query(QUERY), vllm_query("explain gravity")]
    docs = [vllm_document(DOCS[0]), vllm_document(DOCS[1])]
    expected = yes_no_scores(
        reranker_dirs["original"], [q + d for q, d in zip(queries, docs, strict=True)]
    )
    assert abs(expected[0] - expected[1]) > 1e-3  # distinct pairs score differently
    got = scores_of(reranker, queries, docs)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-5
    documents = [vllm_document(doc) for doc in DOCS]
    expected = yes_no_scores(reranker_dirs["original"], [queries[0] + d for d in documents])
    got = scores_of(reranker, queries[0], documents)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-5


def test_pair_is_tokenized_as_one_text(reranker) -> None:
    """vLLM tokenizes first + second once (no pair encoding, no boundary between the two):
    a word split across the two texts is one word, and truncation cuts the end of the whole."""
    processor = reranker.input_processor
    tokenizer = processor.tokenizer
    first, second = "the capital of fr", "ance is paris"
    assert tokenizer(first + second).input_ids != (
        tokenizer(first).input_ids + tokenizer(second).input_ids
    )  # the precondition: separate tokenization would differ
    params = reranker._params_list(1, None, "score", None)
    (request,) = processor.process_pairs([(first, second)], params)
    assert request.prompt_token_ids == tokenizer(first + second).input_ids
    assert request.token_type_ids is None
    params = reranker._params_list(1, None, "score", 4)
    (request,) = processor.process_pairs([(first, second)], params)
    assert request.prompt_token_ids == tokenizer(first + second).input_ids[:4]


def test_yes_no_scores_match_transformers(templated, reranker_dirs) -> None:
    """The built-in template, asked for: plain texts rendered into Qwen3-Reranker's prompt."""
    expected = reference_scores(reranker_dirs["original"], QUERY, DOCS, QWEN3_RERANKER_INSTRUCTION)
    assert max(expected) - min(expected) > 1e-3  # distinct pairs score differently
    assert templated.model_config.num_labels == 1
    got = scores_of(templated, QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-5


def test_template_is_never_applied_unasked(reranker, templated) -> None:
    """Plain texts without a template are read as they are: other scores than templated ones."""
    plain, formatted = scores_of(reranker, QUERY, DOCS), scores_of(templated, QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(plain, formatted, strict=True)) > 1e-3


def test_template_options_are_checked(reranker_dirs) -> None:
    folder = str(reranker_dirs["original"])
    with pytest.raises(ValueError, match="score_template='qwen3-reranker' is not a built-in"):
        LLM(folder, hf_overrides=QWEN3_RERANKER, score_template="qwen3-reranker", device="cpu")
    with pytest.raises(ValueError, match="score_instruction fills the .instruction. of a score"):
        LLM(folder, hf_overrides=QWEN3_RERANKER, score_instruction="find it", device="cpu")


def test_instruction_is_configurable(reranker_dirs) -> None:
    instruction = "Find the passage that names a capital city"
    llm = LLM(
        str(reranker_dirs["original"]),
        hf_overrides=QWEN3_RERANKER,
        score_template="qwen3_reranker",
        score_instruction=instruction,
        device="cpu",
        dtype="float32",
    )
    expected = reference_scores(reranker_dirs["original"], QUERY, DOCS[:2], instruction)
    got = scores_of(llm, QUERY, DOCS[:2])
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-5


def test_converted_seq_cls_checkpoint_gives_the_same_scores(templated, reranker_dirs) -> None:
    converted = LLM(
        str(reranker_dirs["seq_cls"]),
        score_template="qwen3_reranker",
        device="cpu",
        dtype="float32",
    )
    assert converted.model_config.architecture == "Qwen3ForSequenceClassification"
    got, expected = scores_of(converted, QUERY, DOCS), scores_of(templated, QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-5


def test_convert_classify_with_tokens_is_the_same_reranker(reranker, reranker_dirs) -> None:
    """tidepool's spelling: convert="classify" picks the *ForSequenceClassification class."""
    overrides = {k: v for k, v in QWEN3_RERANKER.items() if k != "architectures"}
    llm = LLM(
        str(reranker_dirs["original"]),
        convert="classify",
        hf_overrides=overrides,
        device="cpu",
        dtype="float32",
    )
    got, expected = scores_of(llm, QUERY, DOCS), scores_of(reranker, QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-6


def test_batch_invariance_and_rerank_order(reranker) -> None:
    together = scores_of(reranker, QUERY, DOCS)
    alone = [scores_of(reranker, QUERY, [doc])[0] for doc in DOCS]
    assert len(set(together)) == len(DOCS)
    assert max(abs(a - b) for a, b in zip(together, alone, strict=True)) <= 1e-6
    reversed_scores = scores_of(reranker, QUERY, DOCS[::-1])[::-1]
    assert max(abs(a - b) for a, b in zip(together, reversed_scores, strict=True)) <= 1e-6


def test_bad_document_fails_alone(reranker) -> None:
    docs = [DOCS[0], "", DOCS[2], 7]
    with pytest.raises(BatchInputError) as info:
        reranker.score(QUERY, docs, use_tqdm=False)
    assert sorted(e.index for e in info.value.errors) == [1, 3]
    served = info.value.outputs
    assert served[1] is None and served[3] is None
    expected = scores_of(reranker, QUERY, [DOCS[0], DOCS[2]])
    assert [served[0].outputs.score, served[2].outputs.score] == pytest.approx(expected, abs=1e-6)


def test_template_without_placeholders_is_refused(reranker_dirs) -> None:
    with pytest.raises(ValueError, match=r"\{document\} is missing"):
        ScoreTemplate.parse("<Query>: {query}")
    with pytest.raises(ValueError, match=r"\{query\} appears more than once"):
        ScoreTemplate.parse("{query} {document} {query}")
    with pytest.raises(ValueError, match="placeholders"):
        LLM(
            str(reranker_dirs["original"]),
            hf_overrides=QWEN3_RERANKER,
            score_template="Query: {query} and nothing else",
            device="cpu",
        )


def test_user_template_renders_each_pair(reranker_dirs) -> None:
    template = "Document: {document}\nQuery: {query}\nRelevant:"
    llm = LLM(
        str(reranker_dirs["original"]),
        hf_overrides=QWEN3_RERANKER,
        score_template=template,
        device="cpu",
        dtype="float32",
    )
    # A brace in a user's text is text, not a placeholder.
    pair = ("q {document}", "d {query}")
    request = llm.input_processor.process_pairs(
        [pair], [llm._params_list(1, None, "score", None)[0]]
    )
    rendered = "Document: d {query}\nQuery: q {document}\nRelevant:"
    assert request[0].prompt_token_ids == llm.input_processor.tokenizer(rendered).input_ids


@pytest.mark.parametrize(
    "folder, convert", [("qwen2_cls", "auto"), ("qwen2_cls_as_lm", "classify")]
)
def test_causal_checkpoint_with_score_head_matches_transformers(
    reranker_dirs, folder: str, convert: str
) -> None:
    import transformers

    path = reranker_dirs["qwen2_cls"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(reranker_dirs[folder]), convert=convert, device="cpu", dtype="float32")
    assert llm.model_config.architecture == "Qwen2ForSequenceClassification"
    texts = DOCS[:3]
    got = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    with torch.no_grad():
        expected = torch.stack(
            [torch.softmax(hf(tok(t, return_tensors="pt").input_ids).logits[0], -1) for t in texts]
        )
    assert (got - expected).abs().max() <= 1e-5


def test_causal_lm_without_score_head_says_what_to_do(reranker_dirs) -> None:
    with pytest.raises(ValueError, match="classifier_from_token"):
        LLM(str(reranker_dirs["original"]), convert="classify", device="cpu")


def test_prefix_cache_shares_the_query(reranker) -> None:
    """The formatted query (system prompt, instruction, query) comes before each document: every
    document after the first reads it from the prefix cache."""
    before = reranker.get_metrics()
    scores_of(
        reranker, vllm_query("a query that nobody asked before?"), [vllm_document(d) for d in DOCS]
    )
    after = reranker.get_metrics()
    num_queried = after.prefix_cache_queries - before.prefix_cache_queries
    num_hits = after.prefix_cache_hits - before.prefix_cache_hits
    # The shared prefix is ~70 tokens (4 full blocks of 16) of the ~85 of each prompt.
    assert num_hits >= (len(DOCS) - 1) * 48 and num_hits < num_queried


def test_routes_score_and_rerank(reranker_dirs, reranker) -> None:
    """vLLM's usage over HTTP: formatted texts, the same scores as offline."""
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    engine = AsyncEngine.from_args(
        str(reranker_dirs["original"]), hf_overrides=QWEN3_RERANKER, device="cpu", dtype="float32"
    )
    query, docs = vllm_query(QUERY), [vllm_document(d) for d in DOCS]
    expected = scores_of(reranker, query, docs)
    with TestClient(build_app(engine)) as client:
        body = client.post("/score", json={"text_1": query, "text_2": docs})
        assert body.status_code == 200, body.text
        got = [d["score"] for d in body.json()["data"]]
        assert got == pytest.approx(expected, abs=1e-5)
        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = client.post(route, json={"query": query, "documents": docs})
            assert body.status_code == 200, body.text
            results = body.json()["results"]
            by_index = {r["index"]: r["relevance_score"] for r in results}
            assert [by_index[i] for i in range(len(DOCS))] == pytest.approx(expected, abs=1e-5)
            assert [r["index"] for r in results] == sorted(
                range(len(DOCS)), key=lambda i: -expected[i]
            )
        bad = client.post("/rerank", json={"query": query, "documents": [docs[0], ""]})
        assert bad.status_code == 400, bad.text
    assert all(math.isfinite(s) for s in expected)


def test_which_pairs_are_concatenated(caplog) -> None:
    """vLLM's use_sep_token: an LM read as a reranker concatenates (and a Qwen3-Reranker given no
    template warns, as vLLM does; "none" is a choice and does not); `use_sep_token: true` or a
    checkpoint head keeps the pair encoding."""
    import logging
    from types import SimpleNamespace

    from tidepool.engine.score_template import CONCATENATION, resolve_score_template

    qwen3 = SimpleNamespace(classifier_method="from_2_way_softmax", is_original_qwen3_reranker=True)
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        assert resolve_score_template(None, None, qwen3) == CONCATENATION
        assert resolve_score_template("none", None, qwen3) == CONCATENATION
    warnings = [r.getMessage() for r in caplog.records if "Qwen3-Reranker" in r.getMessage()]
    assert len(warnings) == 1 and "score_template='qwen3_reranker'" in warnings[0]  # not "none"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        assert resolve_score_template("qwen3_reranker", None, qwen3) != CONCATENATION
    assert not caplog.records  # asked for: nothing to warn about
    sep = SimpleNamespace(classifier_method="no_post_processing", use_sep_token=True)
    assert resolve_score_template(None, None, sep) is None
    head = SimpleNamespace(architectures=["Qwen3ForSequenceClassification"])
    assert resolve_score_template(None, None, head) is None
    head.use_sep_token = False
    assert resolve_score_template(None, None, head) == CONCATENATION
