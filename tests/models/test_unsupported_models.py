"""Models tidepool cannot run say so, with what runs instead; and what they point to works.

A CLIPModel or SiglipModel folder without its image processor and encoder-decoders
(T5ForConditionalGeneration) are refused before anything is built (they once got a "runs on the fallback" warning and then an
internal AttributeError). A model_type that transformers does not know (Alibaba GTE's remote-code
NewModel) gets tidepool's message instead of transformers' (a broken hf.co URL; "upgrade
transformers" without auto_map). The ways out they name are run here against transformers:
the text tower of a CLIPModel folder, T5's encoder alone, transformers 5's GteModel port.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_SIZES, TINY_TEXTS, copy_bert_tokenizer
from tolerances import assert_close

from tidepool import LLM, PoolingParams

RAW = PoolingParams(normalize=False)
TEXT = dict(
    vocab_size=30522,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.2,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    image_size=32,
    patch_size=16,
)
MODELS = {
    "clip": lambda: transformers.CLIPModel(
        transformers.CLIPConfig(
            text_config={**TEXT, "eos_token_id": 102, "max_position_embeddings": 77},
            vision_config=VISION,
            projection_dim=16,
        )
    ),
    "siglip": lambda: transformers.SiglipModel(
        transformers.SiglipConfig(text_config=TEXT, vision_config=VISION)
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )
    ),
    "gte": lambda: transformers.GteModel(
        transformers.GteConfig(vocab_size=30522, pad_token_id=0, **TINY_SIZES)
    ),
    "siglip2": lambda: transformers.Siglip2Model(
        transformers.Siglip2Config(text_config=TEXT, vision_config={**VISION, "num_patches": 4})
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("unsupported")
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            folder = root / kind
            folder.mkdir()
            copy_bert_tokenizer(minilm_path, folder)
            torch.manual_seed(90 + list(MODELS).index(kind))
            model = MODELS[kind]().eval()
            model.save_pretrained(str(folder))
            built[kind] = (folder, model)
        return built[kind]

    return get


def _refused(folder: Path, caplog, **kwargs) -> str:
    with caplog.at_level(logging.WARNING, logger="tidepool"):
        with pytest.raises(ValueError) as info:
            LLM(str(folder), device="cpu", **kwargs)
    assert not [r for r in caplog.records if "fallback" in r.getMessage()]  # no false promise
    return str(info.value)


def test_clip_model_without_image_processor_is_refused_and_its_text_tower_runs(saved, caplog):
    """CLIPModel runs natively (tests/models/test_clip.py) where the folder has its image
    processor; without it the load is refused naming the file. Its text tower alone still runs
    on the transformers backend through hf_overrides."""
    folder, hf = saved("clip")
    message = _refused(folder, caplog)
    assert "has neither preprocessor_config.json nor processor_config.json" in message
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        hf_overrides={"architectures": ["CLIPTextModelWithProjection"]},
    )
    outs = llm.embed(TINY_TEXTS, pooling_params=RAW, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    with torch.inference_mode():
        rows = [hf.get_text_features(input_ids=torch.tensor([o.prompt_token_ids])) for o in outs]
    expected = torch.cat([getattr(r, "pooler_output", r) for r in rows])
    assert got.shape == (len(TINY_TEXTS), 16)
    assert_close(got, expected, depth=4, reduction=128)


def test_siglip_model_without_image_processor_is_refused(saved, caplog):
    """SiglipModel runs natively (tests/models/test_siglip.py) where the folder has its image
    processor; without it the load is refused naming the file."""
    message = _refused(saved("siglip")[0], caplog)
    assert "has neither preprocessor_config.json nor processor_config.json" in message


def test_siglip2_model_without_image_processor_is_refused(saved, caplog):
    """Siglip2Model runs natively (tests/models/test_siglip2.py); without its image processor
    the load is refused naming the file."""
    message = _refused(saved("siglip2")[0], caplog)
    assert "has neither preprocessor_config.json nor processor_config.json" in message


def test_t5_for_conditional_generation_is_refused_and_its_encoder_runs(saved, caplog):
    folder, hf = saved("t5")
    message = _refused(folder, caplog)
    assert "T5ForConditionalGeneration is an encoder-decoder model" in message
    assert 'hf_overrides={"architectures": ["T5EncoderModel"]}' in message
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        hf_overrides={"architectures": ["T5EncoderModel"]},
    )
    assert llm.model_config.model_impl == "native"
    outs = llm.embed(TINY_TEXTS, pooling_params=RAW, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    with torch.inference_mode():
        expected = torch.stack(
            [
                hf.encoder(input_ids=torch.tensor([o.prompt_token_ids]))
                .last_hidden_state[0]
                .mean(0)
                for o in outs
            ]
        )
    assert_close(got, expected, depth=3, reduction=128)


def _remote_gte_folder(root: Path, saved, auto_map: bool) -> Path:
    """A folder as Alibaba's GTE ships it: model_type "new", architectures NewModel."""
    folder = root / ("gte-remote" if auto_map else "gte-no-auto-map")
    shutil.copytree(saved("gte")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="new", architectures=["NewModel"])
    if auto_map:
        config["auto_map"] = {
            "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
            "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
        }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gte_remote_code_names_trust_remote_code_and_the_port(saved, tmp_path, caplog):
    message = _refused(_remote_gte_folder(tmp_path, saved, auto_map=True), caplog)
    assert "NewModel is not part of transformers" in message
    assert "Alibaba-NLP/new-impl" in message and "trust_remote_code=True" in message
    assert "GteModel" in message
    assert "hf.co/" not in message


def test_unknown_model_type_without_auto_map_is_explained(saved, tmp_path, caplog):
    message = _refused(_remote_gte_folder(tmp_path, saved, auto_map=False), caplog)
    assert "no auto_map" in message and "GteModel" in message
    assert "upgrade" not in message.lower()


def test_transformers_gte_port_runs_on_the_backend(saved):
    """The port the messages name: GteModel on the transformers backend equals transformers."""
    folder, hf = saved("gte")
    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert llm.model_config.model_impl == "transformers"
    outs = llm.encode(TINY_TEXTS, RAW, pooling_task="token_embed", use_tqdm=False)
    for out in outs:
        with torch.inference_mode():
            expected = hf(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        assert_close(out.outputs.data, expected, depth=3, reduction=128)
