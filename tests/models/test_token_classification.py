"""*ForTokenClassification (per-token labels, pooling_task="token_classify") against
transformers on tiny random BERT / RoBERTa / XLM-R checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_TEXTS, copy_bert_tokenizer
from sparse_models import NER_KINDS, NER_LABELS, save_token_classifier

from tidepool import LLM, PoolingParams
from tidepool.outputs import BatchInputError

TEXTS = [t for t in TINY_TEXTS if t.strip()]
LABELS = NER_LABELS
KINDS = NER_KINDS


@pytest.fixture(scope="module")
def ner_path(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("token_classifiers")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            save_token_classifier(kind, root / kind, minilm_path)
            built[kind] = root / kind
        return built[kind]

    return get


@pytest.fixture(scope="module")
def ner_llm(ner_path):
    engines: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in engines:
            engines[kind] = LLM(str(ner_path(kind)), device="cpu", dtype="float32")
        return engines[kind]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers(kind, ner_path, ner_llm, report_tolerance):
    llm = ner_llm(kind)
    config = llm.model_config
    assert config.pooling_tasks == ("token_classify",)
    assert config.default_pooling_task == "token_classify"
    outputs = llm.encode(TEXTS, use_tqdm=False)
    raw = llm.encode(TEXTS, PoolingParams(activation=False), use_tqdm=False)
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        str(ner_path(kind)), dtype=torch.float32
    ).eval()
    for out, logits_out in zip(outputs, raw, strict=True):
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        assert out.outputs.data.shape == (len(out.prompt_token_ids), len(LABELS))
        torch.testing.assert_close(logits_out.outputs.data, expected, atol=1e-5, rtol=0)
        probs = torch.softmax(expected, dim=-1)
        torch.testing.assert_close(out.outputs.data, probs, atol=1e-5, rtol=0)
        report_tolerance(f"token classify {kind} vs transformers", out.outputs.data, probs)


def test_batch_invariance(ner_llm):
    llm = ner_llm("xlm-roberta")
    together = llm.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    assert not torch.equal(together[0].outputs.data[0], together[0].outputs.data[1])
    for text, out in zip(TEXTS, together, strict=True):
        alone = llm.encode([text], pooling_task="token_classify", use_tqdm=False)[0]
        torch.testing.assert_close(out.outputs.data, alone.outputs.data, atol=1e-6, rtol=1e-6)


def test_other_tasks_are_clear_errors(ner_llm):
    llm = ner_llm("bert")
    with pytest.raises(ValueError, match="classify\\(\\) needs a model with a classification"):
        llm.classify(["x"], use_tqdm=False)
    params = [PoolingParams(task="token_classify"), PoolingParams(task="embed")]
    with pytest.raises(BatchInputError, match="task 'embed' is not supported") as e:
        llm.encode(["a", "b"], params, use_tqdm=False)
    assert e.value.outputs[0] is not None and e.value.outputs[1] is None


@pytest.mark.parametrize(
    "kind,supported", [("bert", "embed, token_embed"), ("bert-cross-encoder", "classify, score")]
)
def test_token_classify_on_a_model_without_the_head_names_the_supported_tasks(
    kind, supported, tiny_llm
):
    """token_classify needs a per-token head: refused before any work, with the tasks the model
    does serve (it replaced the blanket 'not served' refusal of before)."""
    llm = tiny_llm(kind)
    pooler = llm.engine.model_runner.pooler
    assert "token_classify" not in pooler.supported_tasks()
    message = f"'token_classify' is not supported.*supported: {supported}$"
    with pytest.raises(ValueError, match=message):
        pooler.check_params(PoolingParams(task="token_classify"))
    with pytest.raises(ValueError, match=message):
        llm.encode(["a text"], pooling_task="token_classify", use_tqdm=False)


def test_modernbert_via_the_transformers_backend(tmp_path, minilm_path):
    """No native ModernBERT: the transformers backend runs its body, and its own head on each
    token's state."""
    import transformers as tf

    torch.manual_seed(44)
    config = tf.ModernBertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        max_position_embeddings=128,
        initializer_range=0.2,
        local_attention=8,
        global_attn_every_n_layers=3,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        cls_token_id=101,
        sep_token_id=102,
        num_labels=len(LABELS),
        id2label=LABELS,
    )
    model = tf.ModernBertForTokenClassification(config).eval()
    model.save_pretrained(str(tmp_path))
    copy_bert_tokenizer(minilm_path, tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "transformers"
    outputs = llm.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    for out in outputs:
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        torch.testing.assert_close(
            out.outputs.data, torch.softmax(expected, dim=-1), atol=1e-5, rtol=0
        )
