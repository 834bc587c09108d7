"""The differential sweep (tests/sweep/README.md): each case of grid.py builds its tiny checkpoint
once, computes its reference once, loads tidepool once per (checkpoint, path, dtype, options), and
compares every input, packed and alone, with the bound of its precision (references.py).

Default: the fixed CI subset (`ci=True` in grid.py). TIDEPOOL_SWEEP=full: the whole grid.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_features import requires_cpu_kernel, requires_int8_gemm
from tolerances import float32_rtol

from sweep import images, references
from sweep.builders import build
from sweep.grid import Case, Model, selected_cases


def _param(case: Case):
    marks = []
    if case.backend == "kernel":
        marks.append(requires_cpu_kernel)
    if case.quantization == "int8":
        marks.append(requires_int8_gemm)
    if case.xfail:
        # Strict, and only for the ways a wrong answer fails: a broken harness still errors.
        raises = (AssertionError, RuntimeError, ValueError)
        marks.append(pytest.mark.xfail(strict=True, raises=raises, reason=case.xfail))
    return pytest.param(case, id=case.id, marks=marks)


class World:
    """Everything built once per session: folders, references, engines."""

    def __init__(self, root: Path, minilm_path: Path) -> None:
        self.root = root
        self.minilm_path = minilm_path
        self.folders: dict[str, Path] = {}
        self.max_lens: dict[str, int] = {}
        self.inputs: dict[tuple[str, str], Any] = {}
        self.refs: dict[tuple[str, str], Any] = {}
        self.engines: dict[tuple, Any] = {}
        self.loader_backends: dict[tuple, Any] = {}

    def folder(self, model: Model) -> Path:
        if model.key not in self.folders:
            self.folders[model.key] = build(
                model, self.root / model.key.replace("/", "__"), self.minilm_path
            )
        return self.folders[model.key]

    def load(self, case: Case):
        from tidepool import LLM

        kwargs: dict[str, Any] = dict(device="cpu", dtype=case.dtype, **case.llm_kwargs)
        if case.path != "auto":
            kwargs["model_impl"] = case.path
        if case.quantization:
            kwargs["quantization"] = case.quantization
        return LLM(str(self.folder(case.model)), **kwargs)

    def engine(self, case: Case):
        key = case.engine_key
        if key not in self.engines:
            llm = self.load(case)
            self.engines[key] = llm
            self.loader_backends[key] = llm.engine.model_runner.model.attention_backend
        llm = self.engines[key]
        self._set_backend(llm, case)
        return llm

    def _set_backend(self, llm, case: Case) -> None:
        from tidepool.attention.backend import BUCKETED_SDPA, CPU_KERNEL

        if case.output in images.OUTPUTS:
            images.set_backend(llm, case)
            return
        model = llm.engine.model_runner.model
        if case.backend is None:
            model.set_attention_backend(self.loader_backends[case.engine_key])
            return
        backend = {"sdpa": BUCKETED_SDPA, "kernel": CPU_KERNEL}[case.backend]
        spec = model.attention_spec(torch.device("cpu"), torch.float32)
        assert backend.supports(spec), f"{case.id}: {backend.name} does not take {spec}"
        model.set_attention_backend(backend)

    def max_len(self, case: Case, llm) -> int:
        """The model's max_model_len: the same on every path (the inputs are shared)."""
        got = llm.model_config.max_model_len
        seen = self.max_lens.setdefault(case.model.key + repr(sorted(case.llm_kwargs.items())), got)
        assert got == seen, f"{case.id}: max_model_len {got} here, {seen} on another path"
        return got

    def inputs_and_reference(self, case: Case, llm) -> tuple[Any, Any]:
        key = (case.model.key, case.output)
        if key not in self.refs:
            folder = self.folder(case.model)
            max_len = self.max_len(case, llm)
            tokenizer = llm.get_tokenizer()
            if case.output in images.OUTPUTS:
                inputs: Any = images.inputs(case.model, folder)
                self.inputs[key] = inputs
                self.refs[key] = images.REFERENCES[case.output](case.model, folder, inputs)
                return self.inputs[key], self.refs[key]
            if case.output == "cross_encoder":
                inputs = references.text_pairs(tokenizer, case.model.seed, max_len)
            elif case.output == "bge_m3":
                inputs = [
                    q + " " + d
                    for q, d in references.text_pairs(tokenizer, case.model.seed, max_len - 1)
                ]
            elif case.output == "rerank_vllm":
                inputs = references.vllm_reranker_texts(tokenizer, case.model.seed, max_len)
            else:
                vocab = int(llm.model_config.hf_config.vocab_size)
                inputs = references.token_inputs(case.model, vocab, max_len)
            self.inputs[key] = inputs
            self.refs[key] = references.REFERENCES[case.output](case.model, folder, inputs)
        return self.inputs[key], self.refs[key]


@pytest.fixture(scope="session")
def sweep_world(tmp_path_factory, minilm_path) -> World:
    return World(tmp_path_factory.mktemp("sweep"), minilm_path)


@pytest.mark.parametrize("case", [_param(c) for c in selected_cases()])
def test_sweep(case: Case, sweep_world: World, caplog) -> None:
    if case.output == "refuse":
        with pytest.raises((ValueError, NotImplementedError)) as error:
            sweep_world.load(case)
        assert re.search(case.refuses, str(error.value)), str(error.value)
        return
    caplog.set_level(logging.WARNING, logger="tidepool")
    llm = sweep_world.engine(case)
    if case.path != "auto":
        assert llm.model_config.model_impl == case.path
    if case.quantization == "int8":  # the load check may keep float32: then int8 is not tested
        from tidepool.quantization.int8_linear import Int8Linear

        modules = llm.engine.model_runner.model.modules()
        assert any(isinstance(m, Int8Linear) for m in modules), f"{case.id}: int8 kept float32"
    inputs, ref = sweep_world.inputs_and_reference(case, llm)
    if case.output in images.OUTPUTS:
        _check_images(case, llm, inputs, ref)
        return
    references.guard(case, ref)
    max_len = sweep_world.max_len(case, llm)
    bound = references.Bound.of(case, max_len)
    packed = references.run_tidepool(llm, case.output, inputs)
    references.check(case, bound, packed, ref, "packed")
    alone = references.run_alone(llm, case.output, inputs)
    references.check(case, bound, alone, ref, "alone")


def _check_images(case: Case, llm, inputs: list, ref: list) -> None:
    """An image case (images.py): packed, then each item alone, with the entry's bound."""
    config = case.model.config
    bound = references.Bound(case.dtype, int(config["depth"]), int(config["reduction"]))
    images.guard(case, inputs, ref, float32_rtol(bound.depth, bound.reduction))
    hits = llm.get_metrics().prefix_cache_hits
    packed = images.run_tidepool(llm, case.output, inputs)
    references.check(case, bound, packed, ref, "packed")
    alone = [images.run_tidepool(llm, case.output, [item])[0] for item in inputs]
    references.check(case, bound, alone, ref, "alone")
    if case.output == "vlm_last" and case.llm_kwargs.get("enable_prefix_caching", True):
        # The repeated long prompts hit the prefix cache: that path ran (images.py). MEAN
        # pooling reads every token's state, so it skips reading the cache (as vLLM).
        assert llm.get_metrics().prefix_cache_hits > hits, f"{case.id}: no prefix-cache hit"
