"""Adding an output kind is one module: a toy head registered here, in a test module, without
editing any tidepool file, detected from a checkpoint and run end to end through `LLM.encode`.

The toy ("token_norms") answers token_classify with each token's hidden-state L2 norm [len, 1];
a checkpoint calls for it with a `token_norms.json` beside its config. Its reference is
transformers' BertModel: the norms of `last_hidden_state`.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY_SIZES, TINY_TEXTS
from tolerances import assert_close

from tidepool import LLM
from tidepool.engine.tasks import check_task_supported
from tidepool.models.interfaces import EncoderModel
from tidepool.output_heads import (
    Checkpoint,
    HeadChoice,
    OutputHead,
    PoolerContext,
    get_head,
    register_head,
    registered_heads,
    unregister_head,
)
from tidepool.params import PoolingParams

TEXTS = [t for t in TINY_TEXTS if t.strip()]
MARKER = "token_norms.json"


def token_norms(
    model: EncoderModel,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    return rows.float().norm(dim=-1, keepdim=True).cpu()


def detect(checkpoint: Checkpoint) -> HeadChoice | None:
    if checkpoint.may_take_a_head and (checkpoint.path / MARKER).is_file():
        return HeadChoice("embed", checkpoint.architecture, "token_norms")
    return None


TOKEN_NORMS = OutputHead(
    name="token_norms",
    tasks=("token_classify",),
    protocol=EncoderModel,
    provides="encoder body (forward over packed prompts)",
    token_poolers={"token_classify": token_norms},
    detect=detect,
    kind="a token-norm model",
    label="token norms",
)


@pytest.fixture(scope="module")
def toy_head():
    register_head(TOKEN_NORMS)
    yield TOKEN_NORMS
    unregister_head(TOKEN_NORMS.name)


@pytest.fixture(scope="module")
def norms_path(tmp_path_factory, tiny_model_path) -> Path:
    folder = tmp_path_factory.mktemp("token_norms") / "bert"
    shutil.copytree(tiny_model_path("bert"), folder)
    (folder / MARKER).write_text("{}", encoding="utf-8")
    return folder


def test_the_toy_head_runs_end_to_end(toy_head, norms_path):
    from transformers import AutoModel

    llm = LLM(str(norms_path), device="cpu", dtype="float32")
    config = llm.model_config
    assert (config.output_head, config.pooling_tasks) == ("token_norms", ("token_classify",))
    outputs = llm.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    reference = AutoModel.from_pretrained(str(norms_path), dtype=torch.float32).eval()
    for text, out in zip(TEXTS, outputs, strict=True):
        with torch.no_grad():
            ids = torch.tensor([out.prompt_token_ids])
            hidden = reference(input_ids=ids).last_hidden_state[0]
        expected = hidden.norm(dim=-1, keepdim=True)
        depth = TINY_SIZES["num_hidden_layers"] + 1
        assert_close(out.outputs.data, expected, depth=depth, reduction=128, msg=text)
    assert not torch.equal(outputs[0].outputs.data[0], outputs[0].outputs.data[1])  # guard
    # Its refusals name it: the other tasks are refused up front with the head's own words.
    refused = r"needs an embedding model \(BertModel is a token-norm model; it supports token_cl"
    with pytest.raises(ValueError, match=refused):
        llm.embed(["x"], use_tqdm=False)
    # A plain embedder asked for token_classify: the refusal lists every head serving it.
    plain = replace(config, output_head="task", head_tasks=())
    needs = r"a token classification model \(\*ForTokenClassification, BGE-M3, token norms\)"
    with pytest.raises(ValueError, match=needs):
        check_task_supported(plain, "token_classify")


def test_a_model_without_the_protocol_is_refused_at_load(toy_head):
    with pytest.raises(TypeError, match="object has no encoder body .* cannot serve token_norms"):
        toy_head.bind(object())


def test_the_registry_refuses_a_taken_name_and_an_unknown_task(toy_head):
    assert [h.name for h in registered_heads()][-1] == "token_norms"
    assert get_head("token_norms") is toy_head
    with pytest.raises(ValueError, match="'token_norms' is already registered"):
        register_head(toy_head)
    with pytest.raises(ValueError, match="unknown pooling task 'reward'"):
        OutputHead(name="reward", tasks=("reward",), protocol=object, provides="")
    with pytest.raises(ValueError, match="output head 'empty' serves no pooling task"):
        OutputHead(name="empty", tasks=(), protocol=object, provides="")
    with pytest.raises(ValueError, match="output_head must be one of task, .*got 'nope'"):
        get_head("nope")
