"""How close `quantization="int8"` stays to float32: cosine per text and top-10 retrieval overlap.

On the fixed corpus (benchmarks/corpus.py; one text set per `--seeds` entry), each text embedded
by tidepool in float32 and by each int8 variant (VARIANTS: a recipe for `quantize_model`, run by
tidepool's Int8Linear or by a simulated activation quantizer, int8_simulate.py), quantized in
place in one float32 engine (and bfloat16 for scale): the min / mean cosine of a text's int8 vector to its float32
one, and the top-10 nearest-neighbour overlap: for each text as a query against all the others,
the share of its 10 nearest neighbours (cosine) under int8 that are also its 10 nearest under
float32. Issue 17's targets on all-MiniLM-L6-v2: cos mean >= 0.995, min >= 0.99, overlap >= 0.95.

    python benchmarks/int8_accuracy.py [--model PATH] [--texts 1000] [--seeds 0,1]
        [--variants nearest,gptq,gptq-asym] [--only REGEX] [--alpha A] [--smoothed ROLES]
        [--damping D] [--clip] [--random-per-text N] [--asym-inputs none|one_sided|all] [--bf16]
        [--two-part 'SET;SET;...'] [--two-part-hi nearest|gptq] [--two-part-inputs REGEX]

`--two-part`: each variant runs once per set of two-part linears (W ≈ s·(hi + lo/254)); a set is
"none", or roles joined by "+": qkv, attn-out, ffn-up, ffn-down, all (TWO_PART_ROLES; the model's
own `int8_layout` roles, models/quantizable.py), e.g. 'none;qkv;ffn-down;qkv+ffn-down'. The row prints the set's share of the linear FLOPs.
`--two-part-inputs REGEX` (simulated variants): those linears' inputs are two-part too (uint8 and
its rounding error at 1/254 of a step: int8_simulate.py's "asymmetric2").
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from corpus import make_corpus  # noqa: E402
from int8_simulate import SimulatedInt8Linear, simulated_builder  # noqa: E402

from tidepool import LLM  # noqa: E402
from tidepool.models.interfaces import attach_attention_backend  # noqa: E402
from tidepool.models.layers.linear import Linear  # noqa: E402
from tidepool.models.quantizable import (  # noqa: E402
    ATTENTION_OUT,
    FFN_DOWN,
    FFN_UP,
    LINEAR_ROLES,
    QKV,
)
from tidepool.quantization import int8 as quantization  # noqa: E402
from tidepool.quantization.int8 import (  # noqa: E402
    Int8Recipe,
    build_int8_linear,
    calibration_sequences,
    quantize_model,
)


@dataclass(frozen=True)
class Agreement:
    """One mode's vectors against float32's."""

    min_cosine: float
    """Lowest cosine of a text's vector to its float32 vector."""
    mean_cosine: float
    """Mean of those cosines."""
    top10_overlap: float
    """Mean share of each text's 10 nearest neighbours that float32 also ranks in its top 10."""


def embed(llm: LLM, texts: list[str]) -> torch.Tensor:
    outputs = llm.embed(
        texts, use_tqdm=False, truncate_prompt_tokens=llm.model_config.max_model_len
    )
    return torch.stack([torch.as_tensor(o.outputs.embedding, dtype=torch.float32) for o in outputs])


def _top_neighbours(vectors: torch.Tensor, k: int) -> torch.Tensor:
    unit = torch.nn.functional.normalize(vectors, dim=1)
    sims = unit @ unit.T
    sims.fill_diagonal_(-2.0)  # a text is not its own neighbour
    return sims.topk(k, dim=1).indices


def agreement(vectors: torch.Tensor, reference: torch.Tensor, k: int = 10) -> Agreement:
    cos = torch.nn.functional.cosine_similarity(vectors, reference)
    ours, theirs = _top_neighbours(vectors, k), _top_neighbours(reference, k)
    shared = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ours, theirs, strict=True))
    return Agreement(float(cos.min()), float(cos.mean()), shared / ours.numel())


@dataclass(frozen=True)
class Variant:
    """One way to quantize: the recipe, and which layers build it (real or simulated)."""

    recipe: Int8Recipe
    """What `quantize_model` plans."""
    weights: str = "int8"
    """Simulated layers' weights: "int8" (the plan's) or "float"."""
    inputs: str | None = None
    """None: tidepool's Int8Linear (the real kernel); else the simulated activation quantizer:
    "plan", "symmetric", "asymmetric" or "float" (int8_simulate.py)."""


NEAREST = Int8Recipe(weight_rounding="nearest")
VARIANTS = {
    # Round to nearest, symmetric per token (the first shipped recipe), real kernel / simulated.
    "nearest": Variant(NEAREST),
    "nearest-sim": Variant(NEAREST, inputs="symmetric"),
    "nearest-weights-only": Variant(NEAREST, inputs="float"),
    "float-weights-sym": Variant(NEAREST, weights="float", inputs="symmetric"),
    "float-weights-asym": Variant(NEAREST, weights="float", inputs="asymmetric"),
    "float-weights-asym-one-sided": Variant(
        Int8Recipe(asymmetric_inputs="one_sided"), weights="float", inputs="plan"
    ),
    "nearest-asym": Variant(NEAREST, inputs="asymmetric"),
    # GPTQ weights.
    "gptq": Variant(Int8Recipe()),
    "gptq-weights-only": Variant(Int8Recipe(), inputs="float"),
    "gptq-asym-one-sided": Variant(Int8Recipe(asymmetric_inputs="one_sided"), inputs="plan"),
    "gptq-asym": Variant(Int8Recipe(), inputs="asymmetric"),
    "gptq-plan": Variant(Int8Recipe(), inputs="plan"),
    "float-weights-plan": Variant(Int8Recipe(), weights="float", inputs="plan"),
}


TWO_PART_ROLES = {
    "qkv": (QKV,),
    "attn-out": (ATTENTION_OUT,),
    "ffn-up": (FFN_UP,),
    "ffn-down": (FFN_DOWN,),
    "all": LINEAR_ROLES,
}
"""--two-part's and --smoothed's names → the linear roles (models/quantizable.py)."""


def _roles(names: list[str]) -> tuple[str, ...]:
    unknown = [n for n in names if n not in TWO_PART_ROLES]
    if unknown:
        raise SystemExit(f"unknown role {', '.join(unknown)}; expected {', '.join(TWO_PART_ROLES)}")
    return tuple(role for n in names for role in TWO_PART_ROLES[n])


def two_part_sets(spec: str) -> list[tuple[str, tuple[str, ...]]]:
    """'none;qkv+ffn-down' → [("none", ()), ("qkv+ffn-down", ("qkv", "ffn_down"))]."""
    return [
        (label, _roles([] if label == "none" else label.split("+"))) for label in spec.split(";")
    ]


def _flop_share(model: torch.nn.Module, plans: dict) -> float:
    """The two-part linears' share of the int8 linears' FLOPs (N · K each per token)."""
    sizes = {n: m.in_features * m.out_features for n, m in model.named_modules() if n in plans}
    total = sum(sizes.values())
    return sum(sizes[n] for n, p in plans.items() if p.weight_lo is not None) / total


@dataclass(frozen=True)
class TextSet:
    """A corpus sample and its float32 vectors."""

    seed: int
    """The corpus seed."""
    texts: list[str]
    """The texts."""
    reference: torch.Tensor
    """Their float32 vectors."""


def _measure(
    llm: LLM,
    variant: Variant,
    overrides: dict,
    sets: list[TextSet],
    only: str | None,
    random_per_text: int = 1,
    two_part_inputs: str | None = None,
) -> list:
    """Quantize the float32 model in place by `variant` (only the linears whose name matches
    the regex `only`, when given; simulated layers matching `two_part_inputs` take two-part
    inputs), return (load seconds, check, two-part FLOP share, agreements per set), and put
    the float32 layers back."""
    model = llm.engine.model_runner.model
    originals = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    config = llm.model_config
    sequences = calibration_sequences(
        Path(config.path),
        config.max_model_len,
        config.hf_config.vocab_size,
        random_per_text=random_per_text,
    )
    build = build_int8_linear
    if variant.inputs is not None:
        build = simulated_builder(variant.weights, variant.inputs)
    recipe = replace(variant.recipe, **overrides)
    start = time.perf_counter()
    check = quantize_model(model, sequences, recipe, build)
    seconds = time.perf_counter() - start
    for name, linear in originals.items():
        if only is not None and not re.search(only, name):
            quantization._set_submodule(model, name, linear)
            check.plans.pop(name, None)
        elif two_part_inputs is not None and re.search(two_part_inputs, name):
            simulated = model.get_submodule(name)
            assert isinstance(simulated, SimulatedInt8Linear), "--two-part-inputs: simulated only"
            simulated.input_scheme = "asymmetric2"
    share = _flop_share(model, check.plans)
    # The attention the loader gives an int8 model (TIDEPOOL_CPU_ATTENTION_MATMUL chooses).
    attach_attention_backend(model, config.device, config.dtype, reduced_precision=True)
    print(f"  attention: {model.attention_backend}", flush=True)
    try:
        return [seconds, check, share] + [agreement(embed(llm, s.texts), s.reference) for s in sets]
    finally:
        for name, linear in originals.items():
            quantization._set_submodule(model, name, linear)
        attach_attention_backend(model, config.device, config.dtype, reduced_precision=False)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--seeds", default="0,1", help="corpus seeds: one text set each")
    parser.add_argument("--variants", default="gptq", help=", ".join(VARIANTS))
    parser.add_argument("--alpha", type=float, help="override the SmoothQuant alpha")
    parser.add_argument("--damping", type=float, help="override GPTQ's damping")
    parser.add_argument("--random-per-text", type=int, default=1, help="calibration's random ids")
    parser.add_argument("--input-noise", action="store_true", help="GPTQ: noise-aware Xᵀ X")
    parser.add_argument("--clip", action="store_true", help="GPTQ with the clipping search")
    parser.add_argument("--asym-inputs", help="override asymmetric_inputs (plan inputs)")
    parser.add_argument(
        "--smoothed", help="override the smoothed linears (comma-separated --two-part roles)"
    )
    parser.add_argument(
        "--only",
        help="quantize only the linears matching this regex, e.g. 'attention\\.self\\.qkv', "
        "'attention\\.output', 'intermediate', 'layer\\.\\d+\\.output'",
    )
    parser.add_argument("--two-part", help="sets of two-part linears, ';'-separated (see above)")
    parser.add_argument("--two-part-alpha", type=float, help="alpha on smoothed two-part linears")
    parser.add_argument("--two-part-hi", help="override two_part_hi: nearest or gptq")
    parser.add_argument("--two-part-inputs", help="regex: simulated linears with two-part inputs")
    parser.add_argument("--bf16", action="store_true", help="also bfloat16, for scale")
    return parser.parse_args()


def _overrides(args: argparse.Namespace) -> dict:
    """The recipe fields the flags override."""
    overrides: dict = {}
    if args.alpha is not None:
        overrides["smoothing_alpha"] = args.alpha
    if args.damping is not None:
        overrides["gptq_damping"] = args.damping
    if args.input_noise:
        overrides["gptq_input_noise"] = True
    if args.clip:
        overrides["clip_search"] = True
    if args.asym_inputs is not None:
        overrides["asymmetric_inputs"] = args.asym_inputs
    if args.smoothed is not None:
        names = (x for x in args.smoothed.split(",") if x)
        overrides["smoothed_roles"] = _roles(list(names))
    if args.two_part_alpha is not None:
        overrides["two_part_alpha"] = args.two_part_alpha
    if args.two_part_hi is not None:
        overrides["two_part_hi"] = args.two_part_hi
    return overrides


def main() -> None:
    args = _parse_args()
    overrides = _overrides(args)
    sets_of_two_part = [("default", None)]
    if args.two_part is not None:
        sets_of_two_part = two_part_sets(args.two_part)
    llm = LLM(model=args.model)
    sets = []
    for seed in (int(x) for x in args.seeds.split(",")):
        texts = make_corpus(args.texts, seed=seed)
        sets.append(TextSet(seed, texts, embed(llm, texts)))
    print(
        f"{args.model}, {args.texts} corpus texts per seed, against tidepool float32; {overrides}"
    )
    header = "".join(f" | seed {s.seed}: cos min, mean, top-10" for s in sets)
    print(f"{'variant':44} {'load s':>6} {'check min':>9} {'2-part':>6}{header}")
    if args.bf16:
        bf16 = LLM(model=args.model, dtype="bfloat16")
        _print_row(
            "bfloat16", 0.0, None, [agreement(embed(bf16, s.texts), s.reference) for s in sets]
        )
    for name in args.variants.split(","):
        for label, two_part in sets_of_two_part:
            extra = {} if two_part is None else {"two_part_roles": two_part, "two_part": "always"}
            seconds, check, share, *results = _measure(
                llm, VARIANTS[name], {**overrides, **extra}, sets, args.only,
                args.random_per_text, args.two_part_inputs,
            )  # fmt: skip
            row = name if two_part is None else f"{name} 2p={label}"
            _print_row(row, seconds, check, results, share)


def _print_row(
    name: str, seconds: float, check, results: list[Agreement], share: float | None = None
) -> None:
    cells = "".join(
        f" | {r.min_cosine:.5f} {r.mean_cosine:.5f} {r.top10_overlap:.4f}" for r in results
    )
    check_min = f"{check.min_cosine:9.5f}" if check is not None else " " * 9
    share_cell = f"{share:6.0%}" if share is not None else " " * 6
    print(f"{name:44} {seconds:6.2f} {check_min} {share_cell}{cells}", flush=True)


if __name__ == "__main__":
    main()
