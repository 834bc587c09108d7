"""`quantization="int8"`: which models have the path, the checks on a setting, and swapping a
loaded encoder's linear layers for int8 ones (quantization/int8_linear.py), checked at load.

What runs in int8: every `Linear` of the encoder body (fused QKV, attention output, FFN up and
down; DeBERTa's position projections), each with the role its model file declares
(`int8_layout()`, models/quantizable.py: which linear is QKV, FFN down...; the recipe chooses
by role, and the model may change the default recipe). Adding a quantized architecture is its
model file's table (+ tests): nothing here names a model. What stays float32, and why (docs/performance.md, "int8"):
the embeddings and LayerNorms (cheap, and their outputs feed the residual stream), attention
scores, softmax and P·V (never int8: softmax is where int8 errors would grow; once the load check
passed, the loader gives the attention AMX-bf16 products with a float32 softmax where the CPU has
them: attention/backend.py, REDUCED_MATMUL), the pooler and the classification heads (`nn.Linear`: one row per sequence).

Load, in three steps (`quantize_model`, by an `Int8Recipe`):
  1. calibrate: run the float32 model once on a fixed sample (CALIBRATION_TEXTS and random ids);
     as each linear's inputs go by, plan it (`Int8LinearPlan`): QKV's and FFN-up's inputs
     divided per channel by a factor folded into the weight (SmoothQuant: c_k = amax_k^α /
     max_n |W_nk|^(1-α)), which moves the LayerNorm outputs' outlier channels into the weights,
     where each output channel has its own scale; the int8 weights: two-part on
     `two_part_roles` (W ≈ s·(hi + lo/254), two int8 GEMMs, ~15-bit weights: then smoothed
     harder, alpha `two_part_alpha`, since the weight takes the outliers at no loss), else
     rounded by GPTQ from the inputs' Xᵀ X (quantization/weights.py); the activation
     scheme per token (asymmetric uint8 + zero point, or symmetric int8);
  2. swap: each `Linear` → the int8 layer its plan builds;
  3. check: the int8 model's mean-pooled states against float32 on a second sample; below
     `MIN_LOAD_COSINE` the float32 layers stay, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from torch import nn

from tidepool import envs
from tidepool.attention.common import encoder_step
from tidepool.models.layers.linear import Linear
from tidepool.models.quantizable import (
    FFN_DOWN,
    FFN_UP,
    QKV,
    Int8Layout,
    QuantizableModel,
    has_int8_path,
)
from tidepool.quantization.chains import link_handoffs
from tidepool.quantization.int8_linear import (
    Int8Linear,
    int8_gemm_available,
    onednn_int8_saturates,
)
from tidepool.quantization.weights import (
    gptq,
    input_second_moments,
    round_to_nearest,
    split_weight,
)

logger = logging.getLogger("tidepool")

QUANTIZATION_METHODS = ("int8",)

SMOOTHING_ALPHA = 0.5
"""SmoothQuant's migration strength. all-MiniLM-L6-v2, 400 corpus texts (cos min / mean to
float32): no smoothing 0.9918 / 0.9955; calibrated on CALIBRATION_TEXTS + random ids, alpha 0.5:
0.9960 / 0.9980, alpha 0.7: 0.9943 / 0.9981 (on the texts alone 0.7 fell to 0.977: the more
weight it moves, the more a small sample's maxima matter)."""

SMOOTHED_ROLES = (QKV, FFN_UP)
"""The roles (models/quantizable.py) whose input is a LayerNorm output (outlier channels) get
smoothed; the others (attention output, FFN down) take their input as it is: all-MiniLM-L6-v2, 400 texts, smoothing
every linear 0.9945 / 0.9979 (cos min / mean), only these 0.9961 / 0.9980, one pass less each
for the other two."""

TWO_PART_ROLES = (QKV, FFN_UP, FFN_DOWN)
"""The roles (models/quantizable.py) whose weights are two-part int8 (W ≈ s·(hi + lo/254), two
int8 GEMMs: ~15-bit weights): every linear but the attention output (and DeBERTa's position /
embedding projections), 92% of MiniLM's linear FLOPs; the choice against the other subsets, by
top-10 overlap on the corpus: docs/performance.md, "int8", round three."""

TWO_PART_ALPHA = 0.8
"""SmoothQuant's alpha on the smoothed two-part linears (QKV, FFN up): two-part weights take the
inputs' outliers at no loss (alpha against 0.5 and 1.0: docs/performance.md, "int8")."""


MIN_LOAD_COSINE = 0.99
"""The lowest cosine (int8 vs float32, per sample sequence) the load check accepts."""

MAX_ONE_PART_ERROR = 4e-4
"""The load check's 1 - mean cosine up to which a model keeps one-part weights everywhere
(`Int8Recipe.two_part="auto"`); above it, the recipe's two-part linears are planned again with
two-part weights. On the fixed corpus the top-10 overlap lost is ~2.1·sqrt(1 - cos mean), so
issue 17's 0.95 needs ~5.7e-4; the load check's figure tracks the corpus' (all-MiniLM-L6-v2
one-part: 6.2e-4 at load, 7.7e-4 on the corpus, overlap 0.935; two-part 3.0e-4 / 3.2e-4,
0.957), and this leaves a margin. Random-weight BERT-base / MiniLM cross-encoder shapes: one-part
1.8e-5 / 2.6e-6 (no outlier channels), so they keep one GEMM per linear (faster: docs/performance.md, 'Choices elsewhere in the code')."""

# The calibration pass and the load check run on ordinary text, tokenized by the model's own
# tokenizer, and on as many sequences of random token ids (together they measured the most robust
# of text, random ids, both, and 300 corpus texts); even sequences calibrate, odd ones check.
CALIBRATION_TEXTS = (
    "The committee postponed its decision on the new bridge until the engineers report in March.",
    "How do I reset my password if I no longer have access to the email on my account?",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "She moved to Lisbon in 2019, learned Portuguese in a year and now teaches history there.",
    "Add two cups of flour, a pinch of salt and the melted butter, then stir until smooth.",
    "The quarterly report shows revenue up 12% while operating costs fell for a third quarter.",
    "A transformer encoder maps a sequence of tokens to contextual vectors, one per token, "
    "using self-attention layers followed by feed-forward networks and layer normalization.",
    "Is it safe to take ibuprofen together with antibiotics?",
    "The river flooded the lower town twice last century; the new levee was finished in 1998.",
    "Customers who bought this lens also bought a polarizing filter and a spare battery.",
    "Error 404: the page you are looking for might have been removed or is temporarily "
    "unavailable. Check the address, or go back to the home page and search from there.",
    "In chess, castling moves the king two squares towards a rook and the rook to its other side.",
    "Best hiking trails near Denver with waterfalls",
    "The defendant's lawyer argued that the contract was void because it was never signed.",
    "Volcanic ash can ground aircraft for days, as Europe learned in April 2010 when an "
    "Icelandic eruption closed much of its airspace and stranded millions of travellers.",
    "Our team meets every Tuesday at ten to review open tickets and plan the next sprint.",
)


@dataclass(frozen=True)
class QuantizationCheck:
    """What the load check measured."""

    min_cosine: float
    """Lowest cosine of a sample sequence's mean-pooled states, int8 vs float32."""
    mean_cosine: float
    """Their mean."""
    plans: dict[str, Int8LinearPlan] = field(default_factory=dict, repr=False)
    """Each linear's plan, by module name."""

    @property
    def passed(self) -> bool:
        return self.min_cosine >= MIN_LOAD_COSINE


def check_quantization(
    quantization: str | None,
    architecture: str,
    model_impl: str,
    model_cls: type | None,
    with_path: Callable[[], list[str]],
) -> None:
    """ValueError for a method tidepool does not have or a model without the path: the native
    model classes that declare an int8 layout (models/quantizable.py) have it; `with_path`
    lists their architectures (for the message)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATION_METHODS)}"
        )
    if model_impl != "native" or model_cls is None or not has_int8_path(model_cls):
        raise ValueError(
            f"quantization={quantization!r} has no path for {architecture} ({model_impl}); it "
            f"runs on the native encoders: {', '.join(sorted(with_path()))}"
        )


def check_quantization_target(
    quantization: str | None, device: torch.device, dtype: torch.dtype
) -> None:
    """ValueError where the int8 path cannot run: not a CPU, no oneDNN int8, not float32."""
    if quantization is None:
        return
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on CPU only (oneDNN's int8 GEMM), not on "
            f"{device}; on a GPU use dtype='bfloat16' or 'float16'"
        )
    if not int8_gemm_available():
        raise ValueError(
            f"quantization={quantization!r} needs a torch with oneDNN's int8 linear "
            "(torch.ops.onednn.qlinear_pointwise; x86 builds)"
        )
    if dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} runs the layers around its int8 GEMMs in float32; "
            f"leave dtype 'auto' or 'float32' (got {dtype})"
        )
    try:
        saturates = onednn_int8_saturates()
    except RuntimeError as e:
        raise ValueError(f"quantization={quantization!r}: {e}; leave quantization unset") from e
    if saturates:
        logger.warning(
            "int8: this CPU has no VNNI (avx512_vnni / avx_vnni), where oneDNN's u8 x s8 "
            "products saturate on 8-bit inputs: each input runs as two exact 7-bit GEMMs (the "
            "same numbers as on a VNNI CPU, at twice the GEMM cost) with the torch epilogue"
        )


def calibration_sequences(
    path: Path, max_model_len: int, vocab_size: int, seed: int = 0, random_per_text: int = 1
) -> list[torch.Tensor]:
    """CALIBRATION_TEXTS as token ids [len] by the model's tokenizer (with its special tokens),
    and `random_per_text` times as many fixed-seed random id sequences of the same lengths;
    longest first (the packed batch's order)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    encoded = tokenizer(list(CALIBRATION_TEXTS), truncation=True, max_length=max_model_len)
    sequences = [torch.tensor(ids, dtype=torch.int64) for ids in encoded["input_ids"]]
    generator = torch.Generator().manual_seed(seed)
    sequences += [
        torch.randint(0, vocab_size, (len(s),), generator=generator)
        for s in sequences * random_per_text
    ]
    return sorted(sequences, key=len, reverse=True)


@dataclass(frozen=True)
class Int8Recipe:
    """How `quantize_model` chooses each linear's int8 weights and activation scheme."""

    weight_rounding: str = "gptq"
    """"gptq" (error-compensating, from the calibration inputs' Xᵀ X) or "nearest"."""
    gptq_damping: float = 0.3
    """GPTQ's damping, times the mean of diag(Xᵀ X): large, because the sample is small (~350
    tokens for K up to 3,072): all-MiniLM-L6-v2, cos mean 0.99862 / 0.99899 / 0.99912 / 0.99923 /
    0.99926 at 0.001 / 0.01 / 0.1 / 0.3 / 1.0 (round to nearest: 0.99882)."""
    gptq_input_noise: bool = False
    """Add the activation rounding's noise (Σ_t step_t² / 12) to diag(Xᵀ X): GPTQ then does not
    lean on input directions the int8 inputs blur."""
    clip_search: bool = False
    """Choose each channel's scale by an importance-weighted clipping search (GPTQ only)."""
    smoothing_alpha: float = SMOOTHING_ALPHA
    """SmoothQuant's migration strength for `smoothed_roles`."""
    smoothed_roles: tuple[str, ...] = SMOOTHED_ROLES
    """The roles (the model's `int8_layout`) whose inputs are smoothed."""
    two_part_roles: tuple[str, ...] = TWO_PART_ROLES
    """The roles with two-part int8 weights (the smoothed weight where smoothing applies too)."""
    two_part_alpha: float | None = TWO_PART_ALPHA
    """SmoothQuant's alpha on the smoothed two-part linears (None: `smoothing_alpha`): their
    weights are fine enough to take more of the inputs' outliers."""
    two_part: str = "auto"
    """Whether `two_part_roles` get two-part weights: "auto" (only when one-part weights
    everywhere leave the load check's error above MAX_ONE_PART_ERROR), "always" or "never";
    TIDEPOOL_INT8_TWO_PART, where set, replaces it in whatever recipe is in use."""
    two_part_hi: str = "nearest"
    """A two-part weight's high part: "nearest" (no GPTQ: lo holds the rest to 1/508 of a step)
    or "gptq" (GPTQ's, lo holding what is left of its error, clamped to ±1/2 step)."""
    asymmetric_inputs: str = "all"
    """Which linears quantize their input asymmetric per token (uint8 and a zero point):
    "none", "one_sided" (calibration inputs' min >= -ONE_SIDED_RATIO · max: a GELU / ReLU
    output) or "all"."""


DEFAULT_RECIPE = Int8Recipe()
"""The recipe a model gets unless its `int8_layout` changes some fields (`recipe_for`):
two-part weights on QKV, FFN up and FFN down (smoothed at alpha 0.8 where smoothed), GPTQ
(damping 0.3) on the attention output, smoothing on QKV / FFN up, every input asymmetric:
all-MiniLM-L6-v2, 1,000 corpus texts, cos min / mean 0.99919 / 0.99968, top-10 overlap 0.955 /
0.958 on two text sets (simulated asymmetric inputs; on today's kernels as two Int8Linears per
two-part linear: 0.953 / 0.958; one-part GPTQ everywhere: 0.99923 mean, 0.935; the first recipe,
round to nearest with symmetric inputs: 0.99801, 0.907): docs/performance.md, "int8". The
clipping search, noise-aware GPTQ, more
random-id calibration, smoothing all four linears, alpha 0.65 on one-part weights, two-part
inputs on the attention output measured no better."""


def recipe_for(model: nn.Module, base: Int8Recipe = DEFAULT_RECIPE) -> Int8Recipe:
    """`base` with the model's own changes (its layout's `recipe`); ValueError naming a field
    `Int8Recipe` does not have."""
    changes = dict(int8_layout_of(model).recipe)
    unknown = sorted(set(changes) - {f.name for f in fields(Int8Recipe)})
    if unknown:
        raise ValueError(
            f"{type(model).__name__}'s int8 recipe names {', '.join(unknown)}, which "
            "Int8Recipe does not have"
        )
    return replace(base, **changes)


ONE_SIDED_RATIO = 0.25
"""An input whose most negative value is above -this · its largest is "one-sided"."""


@dataclass(frozen=True)
class Int8LinearPlan:
    """What the calibration chose for one linear (`quantize_model` builds the layer from it)."""

    weight_q: torch.Tensor
    """[N, K] int8 (of the smoothed weight where `input_smoothing` is set)."""
    weight_scale: torch.Tensor
    """[N] float32: one scale per output channel."""
    input_smoothing: torch.Tensor | None
    """[K]: inputs are multiplied by it before quantizing (1 / the SmoothQuant factor)."""
    asymmetric_input: bool
    """Quantize the input per token as uint8 with a zero point instead of symmetric int8."""
    input_range: tuple[float, float]
    """The calibration inputs' (min, max), after smoothing."""
    weight_lo: torch.Tensor | None = None
    """[N, K] int8, two-part weights only: the smoothed weight is
    weight_scale[:, None] · (weight_q + weight_lo / WEIGHT_LO_FACTOR), so with the same
    quantized input q (x ≈ s_x·(q - z)) the layer computes
    s_x · w_scale · (q·hiᵀ + (q·loᵀ) / 254) - (s_x·z) · w_scale · (Σ_k hi + Σ_k lo / 254) + b,
    the two int32 products combined in float32 (254 · q·hiᵀ can overflow int32)."""


Int8Builder = Callable[[Linear, Int8LinearPlan], nn.Module]


def build_int8_linear(linear: Linear, plan: Int8LinearPlan) -> nn.Module:
    """The `Int8Linear` for a plan."""
    # Passed only when set: a one-part plan builds with any Int8Linear.
    extra = {} if plan.weight_lo is None else {"weight_lo": plan.weight_lo}
    return Int8Linear(
        plan.weight_q, plan.weight_scale, linear.bias, linear.activation, plan.input_smoothing,
        asym=plan.asymmetric_input, **extra,
    )  # fmt: skip


def quantize_model(
    model: nn.Module,
    sequences: list[torch.Tensor],
    recipe: Int8Recipe,
    build: Int8Builder = build_int8_linear,
) -> QuantizationCheck:
    """Swap the loaded float32 model's `Linear`s for int8 ones (`build` of each linear's plan,
    by its role in the model's `int8_layout`) in place, calibrated on the even `sequences` and
    checked on the odd ones, unless the check fails (then the float32 layers stay, with a
    warning). `recipe`: the loader's is `recipe_for(model)`. Returns the check's figures."""
    layout = int8_layout_of(model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    calibration, held_out = sequences[0::2], sequences[1::2]
    reference = _mean_pooled(model, held_out)
    two_part = envs.int8_two_part()
    if two_part is not None:
        recipe = replace(recipe, two_part=two_part)
    for attempt in _attempts(recipe):
        plans = _calibrate(model, linears, layout.roles, calibration, attempt)
        for name, linear in linears.items():
            _set_submodule(model, name, build(linear, plans[name]))
        cos = torch.nn.functional.cosine_similarity(_mean_pooled(model, held_out), reference)
        check = QuantizationCheck(float(cos.min()), float(cos.mean()), plans)
        if attempt.two_part != "auto" or 1.0 - check.mean_cosine <= MAX_ONE_PART_ERROR:
            break
        for name, linear in linears.items():  # calibrate the two-part plans on float32
            _set_submodule(model, name, linear)
    if check.passed:
        link_handoffs(model, layout)
    else:
        for name, linear in linears.items():
            _set_submodule(model, name, linear)
        logger.warning(
            "int8 quantization kept float32: the load check's cosine to float32 was %.4f (min; "
            "needs >= %.2f) on a sample",
            check.min_cosine,
            MIN_LOAD_COSINE,
        )
    return check


def int8_layout_of(model: nn.Module) -> Int8Layout:
    """The model's declared layout; ValueError for a model without one, or whose table leaves
    out one of its `Linear`s (each needs a role: nothing is guessed from names)."""
    if not isinstance(model, QuantizableModel):
        raise ValueError(f"{type(model).__name__} declares no int8 layout (models/quantizable.py)")
    layout = model.int8_layout()
    missing = [
        n for n, m in model.named_modules() if isinstance(m, Linear) and n not in layout.roles
    ]
    if missing:
        raise ValueError(
            f"{type(model).__name__}.int8_layout() gives no role to {', '.join(missing)}"
        )
    return layout


def _attempts(recipe: Int8Recipe) -> list[Int8Recipe]:
    """The recipes `quantize_model` tries in turn: with two_part "auto", one-part weights first
    (still "auto": the check decides), then the two-part plan ("always")."""
    if recipe.two_part == "never" or not recipe.two_part_roles:
        return [replace(recipe, two_part_roles=(), two_part="never")]
    if recipe.two_part == "always":
        return [recipe]
    return [replace(recipe, two_part_roles=()), replace(recipe, two_part="always")]


def _forward(model: nn.Module, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Hidden states [num_tokens, hidden] of the packed sequences (longest first, as the runner
    orders a step)."""
    seq_lens = [len(s) for s in sequences]
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    step = encoder_step(
        seq_lens, torch.device("cpu"), torch.float32, model.config.num_attention_heads
    )
    meta = model.attention_backend.metadata_builder().build(step)
    with torch.inference_mode():
        return model(torch.cat(sequences), positions, meta)


def _mean_pooled(model: nn.Module, sequences: list[torch.Tensor]) -> torch.Tensor:
    hidden = _forward(model, sequences)
    return torch.stack([part.mean(0) for part in hidden.split([len(s) for s in sequences])])


def _calibrate(
    model: nn.Module,
    linears: dict[str, Linear],
    roles: Mapping[str, str],
    sequences: list[torch.Tensor],
    recipe: Int8Recipe,
) -> dict[str, Int8LinearPlan]:
    """One float32 pass over the sample; each linear's plan is made from its inputs as they go
    by (so only one linear's Xᵀ X is held at a time)."""
    plans: dict[str, Int8LinearPlan] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            smoothed = roles[name] in recipe.smoothed_roles
            two_part = roles[name] in recipe.two_part_roles
            plans[name] = plan_linear(module, x, recipe, smoothed, two_part)

        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in linears.items()]
    try:
        _forward(model, sequences)
    finally:
        for handle in handles:
            handle.remove()
    return plans


def plan_linear(
    linear: Linear, x: torch.Tensor, recipe: Int8Recipe, smoothed: bool, two_part: bool = False
) -> Int8LinearPlan:
    """One linear's plan from its calibration inputs x [T, K] (`two_part`: hi and lo weights)."""
    weight = linear.weight.detach().float()
    smoothing = None
    if smoothed:
        # SmoothQuant: c_k = amax_k^α / max_n |W_nk|^(1-α); W·c, and the inputs times 1/c.
        alpha = recipe.smoothing_alpha
        if two_part and recipe.two_part_alpha is not None:
            alpha = recipe.two_part_alpha
        w_amax = weight.abs().amax(dim=0).clamp(min=1e-5)
        c = x.abs().amax(dim=0).clamp(min=1e-5).pow(alpha) / w_amax.pow(1.0 - alpha)
        weight, smoothing = weight * c, 1.0 / c
        x = x * smoothing
    low, high = float(x.min()), float(x.max())
    asymmetric = recipe.asymmetric_inputs == "all" or (
        recipe.asymmetric_inputs == "one_sided" and low >= -ONE_SIDED_RATIO * high
    )
    weight_lo = None
    if two_part and recipe.two_part_hi == "nearest":
        weight_q, weight_lo, weight_scale = split_weight(weight)
    elif recipe.weight_rounding == "gptq" or two_part:
        hessian = input_second_moments(x)
        if recipe.gptq_input_noise:
            hessian.diagonal().add_(_input_rounding_noise(x, asymmetric))
        weight_q, weight_scale = gptq(weight, hessian, recipe.gptq_damping, recipe.clip_search)
        if two_part:
            weight_q, weight_lo, weight_scale = split_weight(weight, weight_q, weight_scale)
    else:
        weight_q, weight_scale = round_to_nearest(weight)
    return Int8LinearPlan(weight_q, weight_scale, smoothing, asymmetric, (low, high), weight_lo)


def _input_rounding_noise(x: torch.Tensor, asymmetric: bool) -> float:
    """Σ_t step_t² / 12: what rounding each token's input to its per-token grid adds to every
    diagonal entry of Xᵀ X (uniform error of variance step² / 12, independent per channel)."""
    if asymmetric:
        step = (x.amax(dim=1).clamp(min=0.0) - x.amin(dim=1).clamp(max=0.0)) / 255.0
    else:
        step = x.abs().amax(dim=1) / 127.0
    return float(step.double().square().sum() / 12.0)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
