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
    with pytest.raises(ValueError, match="its own task 'reward' needs a token pooler"):
        OutputHead(name="reward", tasks=("reward",), protocol=object, provides="")
    with pytest.raises(ValueError, match="unknown pooling task 'reward'; expected one of"):
        OutputHead(
            name="r", tasks=("embed",), protocol=object, provides="", task_needs={"reward": "x"}
        )
    with pytest.raises(ValueError, match="output head 'empty' serves no pooling task"):
        OutputHead(name="empty", tasks=(), protocol=object, provides="")
    with pytest.raises(ValueError, match="output_head must be one of task, .*got 'nope'"):
        get_head("nope")


# A head with a task of its own: "norm_reward", one number per text (the mean of its tokens'
# hidden-state norms), a stand-in for a plugin's reward model. Requests may name the task only
# while the head is registered.
REWARD_MARKER = "norm_reward.json"


def norm_reward(
    model: EncoderModel,
    pooler: PoolerContext,
    rows: torch.Tensor,
    ids: torch.Tensor | None,
    params: PoolingParams,
) -> torch.Tensor:
    return rows.float().norm(dim=-1).mean().reshape(1).cpu()


def detect_reward(checkpoint: Checkpoint) -> HeadChoice | None:
    if checkpoint.may_take_a_head and (checkpoint.path / REWARD_MARKER).is_file():
        return HeadChoice("embed", checkpoint.architecture, "norm_reward")
    return None


NORM_REWARD = OutputHead(
    name="norm_reward",
    tasks=("norm_reward",),
    protocol=EncoderModel,
    provides="encoder body (forward over packed prompts)",
    token_poolers={"norm_reward": norm_reward},
    detect=detect_reward,
    kind="a norm reward model",
    label="norm reward",
    task_needs={"norm_reward": "a reward model"},
)


@pytest.fixture(scope="module")
def reward_head():
    register_head(NORM_REWARD)
    yield NORM_REWARD
    unregister_head(NORM_REWARD.name)


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory, tiny_model_path) -> Path:
    folder = tmp_path_factory.mktemp("norm_reward") / "bert"
    shutil.copytree(tiny_model_path("bert"), folder)
    (folder / REWARD_MARKER).write_text("{}", encoding="utf-8")
    return folder


def _reference_rewards(path: Path, outputs) -> list[torch.Tensor]:
    from transformers import AutoModel

    reference = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    for out in outputs:
        with torch.no_grad():
            hidden = reference(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state
        expected.append(hidden[0].norm(dim=-1).mean().reshape(1))
    return expected


def test_a_head_declares_a_task_of_its_own(reward_head, reward_path):
    """Offline: LLM.encode(pooling_task="norm_reward") and the model's default task run the
    head's pooler, equal to transformers' hidden states; the built-in tasks are refused with the
    head's words, and the task's refusal elsewhere names the head."""
    llm = LLM(str(reward_path), device="cpu", dtype="float32")
    config = llm.model_config
    assert (config.output_head, config.pooling_tasks) == ("norm_reward", ("norm_reward",))
    outputs = llm.encode(TEXTS, pooling_task="norm_reward", use_tqdm=False)
    default = llm.encode(TEXTS, use_tqdm=False)
    depth = TINY_SIZES["num_hidden_layers"] + 1
    for text, out, again, expected in zip(
        TEXTS, outputs, default, _reference_rewards(reward_path, outputs), strict=True
    ):
        assert out.outputs.data.shape == (1,)
        assert_close(out.outputs.data, expected, depth=depth, reduction=128, msg=text)
        assert torch.equal(again.outputs.data, out.outputs.data)
    assert len({float(o.outputs.data) for o in outputs}) > 1  # guard: texts differ
    assert PoolingParams(task="norm_reward").task == "norm_reward"
    with pytest.raises(ValueError, match=r"needs an embedding model \(BertModel is a norm rew"):
        llm.embed(["x"], use_tqdm=False)
    plain = replace(config, output_head="task", head_tasks=())
    with pytest.raises(ValueError, match=r"needs a reward model \(norm reward\)"):
        check_task_supported(plain, "norm_reward")


def test_the_server_serves_a_head_task(reward_head, reward_path):
    """/pooling with task="norm_reward" answers the head's output; a task no head declares is a
    400 naming the known ones."""
    from fastapi.testclient import TestClient

    from tidepool.engine.async_engine import AsyncEngine
    from tidepool.entrypoints.openai.server import build_app

    expected = [
        o.outputs.data for o in LLM(str(reward_path)).encode(TEXTS[:3], pooling_task="norm_reward")
    ]
    engine = AsyncEngine.from_args(str(reward_path), device="cpu", dtype="float32")
    with TestClient(build_app(engine)) as client:
        answer = client.post("/pooling", json={"input": TEXTS[:3], "task": "norm_reward"})
        assert answer.status_code == 200, answer.text
        got = [torch.tensor(d["data"]) for d in answer.json()["data"]]
        for g, e in zip(got, expected, strict=True):
            assert_close(g, e, depth=1, reduction=1, msg="the response's float32 values")
        answer = client.post("/pooling", json={"input": "x", "task": "reward"})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "unknown pooling task 'reward'" in message and "'norm_reward'" in message


def test_task_declarations_are_checked_and_withdrawn(reward_head):
    from tidepool.params import declare_pooling_task, known_pooling_tasks, withdraw_pooling_task

    assert "norm_reward" in known_pooling_tasks()
    with pytest.raises(ValueError, match="'norm_reward' is already declared by 'norm_reward'"):
        declare_pooling_task("norm_reward", "other")
    with pytest.raises(ValueError, match="'encode' is a built-in task name"):
        declare_pooling_task("encode", "other")
    with pytest.raises(ValueError, match="must be lower_snake_case"):
        declare_pooling_task("Reward!", "other")
    twin = replace(NORM_REWARD, name="twin", detect=None)
    with pytest.raises(ValueError, match="already declared by 'norm_reward'"):
        register_head(twin)
    assert "twin" not in [h.name for h in registered_heads()]
    # A head whose second task collides withdraws its first on the way out.
    pair = replace(
        NORM_REWARD,
        name="pair",
        detect=None,
        tasks=("pair_task", "norm_reward"),
        token_poolers={"pair_task": norm_reward, "norm_reward": norm_reward},
    )
    with pytest.raises(ValueError, match="already declared"):
        register_head(pair)
    assert "pair_task" not in known_pooling_tasks()
    # Unregistering withdraws the task: requests may no longer name it.
    register_head(
        replace(pair, tasks=("pair_task",), token_poolers={"pair_task": norm_reward}, task_needs={})
    )
    assert PoolingParams(task="pair_task").task == "pair_task"
    unregister_head("pair")
    with pytest.raises(ValueError, match="unknown pooling task 'pair_task'"):
        PoolingParams(task="pair_task")
    withdraw_pooling_task("norm_reward", "someone else")  # not theirs: kept
    assert "norm_reward" in known_pooling_tasks()
