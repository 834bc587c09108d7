"""The int8 quantizers chosen at load: GPTQ weight rounding (quantization/weights.py)
against round to nearest, two-part weights (`split_weight`), and the asymmetric per-token activation quantizer's reference
(benchmarks/int8_simulate.py, the formula the fused kernel implements)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tidepool.quantization.int8_linear import Int8Linear, int8_gemm_available
from tidepool.quantization.weights import (
    WEIGHT_LO_FACTOR,
    gptq,
    input_second_moments,
    round_to_nearest,
    split_weight,
)


def _correlated_inputs(num_tokens: int, in_features: int) -> torch.Tensor:
    """Inputs whose channels move together (as a layer's inputs do), one outlier channel."""
    generator = torch.Generator().manual_seed(1)
    mixing = torch.randn(in_features, in_features, generator=generator) * 0.2
    x = torch.randn(num_tokens, in_features, generator=generator) @ (
        mixing + torch.eye(in_features)
    )
    x[:, 3] *= 20.0
    return x


def _output_error(x: torch.Tensor, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    reference = x @ weight.T
    return float((x @ (q.float() * scale[:, None]).T - reference).norm() / reference.norm())


def test_gptq_lowers_the_output_error_on_held_out_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=generator) * 128**-0.5
    x = _correlated_inputs(1200, 128)
    calibration, held_out = x[:400], x[400:]
    q_near, scale_near = round_to_nearest(weight)
    q_gptq, scale_gptq = gptq(weight, input_second_moments(calibration))
    # Same grid (one abs-max scale per output channel), other integers.
    torch.testing.assert_close(scale_gptq, scale_near)
    assert q_gptq.dtype == torch.int8 and int(q_gptq.abs().max()) <= 127
    assert (q_gptq != q_near).any()
    nearest = _output_error(held_out, weight, q_near, scale_near)
    ours = _output_error(held_out, weight, q_gptq, scale_gptq)
    assert ours < 0.8 * nearest, (ours, nearest)  # measured ~0.6x


def test_gptq_handles_a_dead_input_channel() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 16, generator=generator)
    x = torch.randn(64, 16, generator=generator)
    x[:, 5] = 0.0  # never active: H has a zero row and column
    q, scale = gptq(weight, input_second_moments(x))
    assert torch.isfinite(scale).all() and int(q[:, 5].abs().max()) == 0


def _simulate_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "int8_simulate.py"
    spec = importlib.util.spec_from_file_location("bench_int8_simulate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_asymmetric_per_token_reference() -> None:
    quantize = _simulate_module().quantize_per_token_asymmetric
    generator = torch.Generator().manual_seed(3)
    x = torch.nn.functional.gelu(torch.randn(8, 384, generator=generator) * 2.0)  # >= -0.17
    x[1] = 0.0
    q, scale, zero = quantize(x)
    assert q.dtype == torch.uint8 and zero.dtype == torch.int32
    restored = (q.float() - zero.float()) * scale
    assert ((restored - x).abs() <= scale / 2 + 1e-6).all()  # half a step
    # The range is the row's (min, max) with 0 in it: 255 steps, and 0 restored exactly.
    torch.testing.assert_close(scale[0, 0], (x[0].max() - x[0].min()) / 255.0)
    assert float(restored[1].abs().max()) == 0.0
    # Finer than symmetric int8 on a one-sided row: (max - min) / 255 vs max |x| / 127.
    assert float(scale[0, 0]) < 0.6 * float(x[0].abs().max() / 127.0)


def test_upper_cholesky_of_inverse_matches_the_three_step_form() -> None:
    from tidepool.quantization.weights import upper_cholesky_of_inverse

    torch.manual_seed(0)
    x = torch.randn(500, 300, dtype=torch.float64)
    h = x.T @ x + 0.1 * torch.eye(300, dtype=torch.float64)
    u = upper_cholesky_of_inverse(h)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    assert torch.equal(u, u.triu())
    torch.testing.assert_close(u, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(h), rtol=1e-9, atol=1e-12)


def _outlier_weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 200, generator=generator) * 0.05
    weight[:, 7] *= 30.0  # an outlier column: most of each channel's range is unused
    weight[5] = 0.0  # a channel of zeros
    return weight


def test_split_weight_reconstructs_within_half_a_low_step() -> None:
    weight = _outlier_weight()
    hi, lo, scale = split_weight(weight)
    assert hi.dtype == lo.dtype == torch.int8 and scale.dtype == torch.float32
    assert WEIGHT_LO_FACTOR == 254 and int(lo.abs().max()) <= 127
    # The high part is round to nearest's, on its grid.
    q_near, scale_near = round_to_nearest(weight)
    assert torch.equal(hi, q_near) and torch.equal(scale, scale_near)
    restored = scale[:, None] * (hi.float() + lo.float() / WEIGHT_LO_FACTOR)
    error = (weight - restored).abs()
    # |W - s·(hi + lo/254)| <= s / (2·254), + float32 rounding of W / s (relative 2⁻²⁴ of
    # |W| <= 127 s: ~1e-5 s, 1/200 of the bound).
    bound = scale[:, None] / (2 * WEIGHT_LO_FACTOR) * (1 + 1e-2)
    assert (error <= bound).all(), float((error / bound).max())
    # Every low value is used (the bound is tight, not loose by a factor).
    assert float((error / bound).max()) > 0.9
    # 254x finer than the high part alone (whose error reaches s / 2).
    hi_error = (weight - scale[:, None] * hi.float()).abs()
    assert float(error.max()) < float(hi_error.max()) / 200
    assert float(restored[5].abs().max()) == 0.0


def test_split_weight_keeps_a_given_high_part() -> None:
    """GPTQ's high part: lo holds what is left of its error, clamped at ±1/2 step."""
    weight = _outlier_weight()
    x = _correlated_inputs(300, 200)
    q_gptq, scale = gptq(weight, input_second_moments(x))
    hi, lo, scale_out = split_weight(weight, q_gptq, scale)
    assert torch.equal(hi, q_gptq) and torch.equal(scale_out, scale)
    units = weight / scale[:, None] - hi.float()  # GPTQ's own error, in steps
    assert float(units.abs().max()) > 0.5  # GPTQ moved some values off the nearest
    restored = scale[:, None] * (hi.float() + lo.float() / WEIGHT_LO_FACTOR)
    error = (weight - restored).abs()
    inside = units.abs() <= 0.5
    assert (
        error[inside] <= (scale[:, None] / (2 * WEIGHT_LO_FACTOR) * 1.01).expand_as(error)[inside]
    ).all()
    # Where GPTQ's error exceeds half a step, lo clamps at ±127: what remains is the excess.
    excess = (units.abs() - 127 / WEIGHT_LO_FACTOR).clamp(min=0) * scale[:, None]
    torch.testing.assert_close(error[~inside], excess[~inside], atol=1e-5, rtol=1e-3)


def _meta_model(architecture: str, **sizes):
    """A native model of `architecture` on the meta device (no weights), from a tiny config."""
    import transformers

    from tidepool.model_loader.registry import get_model_class

    kind = {"Bert": "BertConfig", "XLMRoberta": "XLMRobertaConfig", "MPNet": "MPNetConfig"}
    kind |= {"DebertaV2": "DebertaV2Config", "T5": "T5Config", "MT5": "MT5Config"}
    name = next(v for k, v in kind.items() if architecture.startswith(k))
    config = getattr(transformers, name)(**sizes)
    with torch.device("meta"):
        return get_model_class(architecture)(config)


BERT_SIZES = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)
DEBERTA_SIZES = BERT_SIZES | dict(
    embedding_size=16, relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=False
)
T5_SIZES = dict(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2)


@pytest.mark.parametrize(
    "architecture,sizes",
    [
        ("BertModel", BERT_SIZES),
        ("XLMRobertaForSequenceClassification", BERT_SIZES),
        ("MPNetModel", BERT_SIZES),
        ("DebertaV2ForSequenceClassification", DEBERTA_SIZES),
        ("T5EncoderModel", T5_SIZES),
        ("MT5EncoderModel", T5_SIZES | dict(feed_forward_proj="gated-gelu")),
    ],
)
def test_each_linear_has_its_declared_role(architecture: str, sizes: dict) -> None:
    """The model file's table (models/quantizable.py) names every tidepool Linear, by its role,
    and its hand-offs and reused outputs name int8-able linears only."""
    from tidepool.models.layers.linear import Linear
    from tidepool.models.quantizable import LINEAR_ROLES
    from tidepool.quantization.int8 import int8_layout_of

    model = _meta_model(architecture, **sizes)
    layout = int8_layout_of(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, Linear)}
    assert set(layout.roles) == linears and set(layout.roles.values()) <= set(LINEAR_ROLES)
    for h in layout.handoffs:
        assert {h.producer, h.consumer} <= linears, h
    assert all(set(group) <= linears for group in layout.shared_outputs)
    roles = layout.roles
    by_role = {r: sorted(n for n in roles if roles[n] == r) for r in set(roles.values())}
    if architecture.startswith("T5") or architecture.startswith("MT5"):
        gated = "feed_forward_proj" in sizes
        assert len(by_role["ffn_up"]) == 2 * (2 if gated else 1)
        assert all(n.endswith(".o") for n in by_role["attention_out"])
        return
    assert all(n.endswith("attention.output.dense") for n in by_role["attention_out"])
    assert all(".attention." not in n for n in by_role["ffn_down"])
    # Per layer: attention output → FFN up → FFN down → (the next layer's QKV).
    assert len(layout.handoffs) == 3 * 3 - 1
    if architecture.startswith("DebertaV2"):
        assert by_role["projection"] == ["body.embeddings.embed_proj"]
        assert len(by_role["position"]) == 2 * 3


def test_a_linear_without_a_role_is_refused(monkeypatch) -> None:
    from tidepool.models.bert import BertLayer
    from tidepool.quantization.int8 import int8_layout_of

    roles = {k: v for k, v in BertLayer.LINEAR_ROLES.items() if k != "intermediate.dense"}
    monkeypatch.setattr(BertLayer, "LINEAR_ROLES", roles)
    with pytest.raises(ValueError, match="gives no role to encoder.layer.0.intermediate.dense"):
        int8_layout_of(_meta_model("BertModel", **BERT_SIZES))


def test_int8_architectures_are_the_classes_that_declare_a_layout() -> None:
    """The architectures with the int8 path are those whose model file declares it (no list
    elsewhere): the native encoders and cross-encoders, not the per-token heads or decoders."""
    from tidepool.model_loader.registry import int8_architectures

    bodies = ("Bert", "Roberta", "XLMRoberta", "MPNet", "DebertaV2")
    expected = {f"{b}{kind}" for b in bodies for kind in ("Model", "ForSequenceClassification")}
    assert set(int8_architectures()) == expected | {"T5EncoderModel", "MT5EncoderModel"}


def test_model_recipes_change_the_default() -> None:
    """A model's own recipe changes (T5: only QKV smoothed) apply over the base recipe; a field
    the recipe does not have is refused, naming it."""
    from dataclasses import replace

    from tidepool.quantization.int8 import DEFAULT_RECIPE, Int8Recipe, recipe_for

    t5 = _meta_model("T5EncoderModel", **T5_SIZES)
    assert recipe_for(t5) == replace(DEFAULT_RECIPE, smoothed_roles=("qkv",))
    base = Int8Recipe(weight_rounding="nearest")
    assert recipe_for(t5, base).weight_rounding == "nearest"
    bert = _meta_model("BertModel", **BERT_SIZES)
    assert recipe_for(bert) == DEFAULT_RECIPE
    layout = bert.int8_layout()
    bert.int8_layout = lambda: replace(layout, recipe={"smoothing": 0.5})
    with pytest.raises(ValueError, match="names smoothing, which Int8Recipe does not have"):
        recipe_for(bert)


def test_default_two_part_roles_are_all_but_the_attention_output() -> None:
    from tidepool.quantization.int8 import DEFAULT_RECIPE

    assert set(DEFAULT_RECIPE.two_part_roles) == {"qkv", "ffn_up", "ffn_down"}
    assert set(DEFAULT_RECIPE.smoothed_roles) == {"qkv", "ffn_up"}


@pytest.mark.skipif(not int8_gemm_available(), reason="no oneDNN int8 linear")
def test_int8_linear_two_part_weight_contract() -> None:
    """The contract of Int8Linear(weight_q=hi, weight_scale=s, ..., weight_lo=lo): its GEMM uses
    the weight s_n · (hi + lo / WEIGHT_LO_FACTOR). Against the simulated layer (the same input
    quantizer as float32 fake quantization, the dequantized two-part weight): equal to float32
    rounding; against float32: the weight's share of the error gone (one-part leaves it)."""
    simulate = _simulate_module()
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(160, 96, generator=generator) * 0.1
    weight[:, 7] *= 30.0  # coarse one-part steps: the weight's error dominates
    bias = torch.randn(160, generator=generator) * 0.1
    x = torch.randn(40, 96, generator=generator) + 0.3
    hi, lo, scale = split_weight(weight)
    layer = Int8Linear(hi, scale, bias, None, asym=True, weight_lo=lo)
    two_part = layer(x)
    one_part = Int8Linear(hi, scale, bias, None, asym=True)(x)
    x_hat = simulate.fake_quantize(x, "asymmetric")
    expected = torch.nn.functional.linear(
        x_hat, scale[:, None] * (hi.float() + lo.float() / WEIGHT_LO_FACTOR), bias
    )
    # float32 rounding of K = 96 products and the epilogue: the one-part layer against its
    # simulation measured 6e-7 of the range; 1e-5 leaves room for a rounding tie.
    tolerance = 1e-5 * float(expected.abs().max())
    assert float((two_part - expected).abs().max()) <= tolerance
    reference = x @ weight.T + bias
    # Measured in simulation: 0.23x (what is left is the inputs' rounding).
    assert float((two_part - reference).norm()) < 0.4 * float((one_part - reference).norm())
