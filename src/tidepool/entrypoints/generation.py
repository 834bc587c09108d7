"""The offline generation loop behind `LLM.generate` / `LLM.chat`.

    prompts ──InputProcessor──▶ Requests (n per prompt) ──EngineCore.step() loop──▶
    EngineCoreOutputs ──OutputProcessor (detokenize, stop strings)──▶ RequestOutputs

A stop string found by the output processor stops its request in the engine before the next
step; n > 1 completions run as n requests whose prompt blocks are shared by the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tidepool.engine.engine_core import EngineCore
from tidepool.engine.input_processor import InputProcessor
from tidepool.engine.output_processor import OutputProcessor
from tidepool.outputs import BatchInputError, EngineCoreOutput, RequestError, RequestOutput
from tidepool.params import SamplingParams
from tidepool.request import Request

Child = tuple[int, int, SamplingParams]
"""(prompt index, completion index, the completion's parameters)."""


def eos_token_ids(engine: EngineCore, tokenizer) -> tuple[int, ...]:
    """generation_config.json's EOS ids, then the tokenizer's if it is not among them."""
    ids = list(engine.config.model.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(int(tokenizer_eos))
    return tuple(ids)


def run_generation(
    engine: EngineCore,
    input_processor: InputProcessor,
    prompts: list,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    *,
    use_tqdm: bool,
    add_special_tokens: bool,
) -> list[RequestOutput]:
    """One RequestOutput per prompt, in prompt order; invalid prompts raise BatchInputError
    after the others ran (its `outputs` hold their results)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    params = (
        [sampling_params] * len(prompts)
        if isinstance(sampling_params, SamplingParams)
        else list(sampling_params)
    )
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
    # n > 1: a seeded request gives completion k the seed + k, as vLLM does.
    children: list[Child] = [
        (i, k, p if p.n == 1 else replace(p, n=1, seed=None if p.seed is None else p.seed + k))
        for i, p in enumerate(params)
        for k in range(p.n)
    ]
    tokenizer = input_processor.tokenizer
    items = input_processor.process_generate(
        [prompts[i] for i, _, _ in children],
        [p for _, _, p in children],
        eos_token_ids(engine, tokenizer),
        add_special_tokens=add_special_tokens,
    )
    finished = _run(engine, OutputProcessor(tokenizer), items, children, prompts, use_tqdm)
    results: list[RequestOutput | None] = [None] * len(prompts)
    errors: dict[int, str] = {}
    for (i, _, _), item, out in zip(children, items, finished, strict=True):
        if isinstance(item, RequestError):
            errors.setdefault(i, item.message)
        elif out is not None and results[i] is None:
            results[i] = out
        elif out is not None:
            results[i].outputs.extend(out.outputs)  # type: ignore[union-attr]
    for out in results:
        if out is not None:
            out.outputs.sort(key=lambda c: c.index)
    if errors:
        raise BatchInputError([RequestError(i, m) for i, m in sorted(errors.items())], results)
    return results  # type: ignore[return-value]


def _prompt_text(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _run(
    engine: EngineCore,
    output_processor: OutputProcessor,
    items: list[Request | RequestError],
    children: list[Child],
    prompts: list,
    use_tqdm: bool,
) -> list[RequestOutput | None]:
    """Step the engine until every request finished; outputs in `items` order."""
    index_of: dict[str, int] = {}
    for j, (item, (i, k, _)) in enumerate(zip(items, children, strict=True)):
        if isinstance(item, RequestError):
            continue
        engine.add_request(item)
        output_processor.add_request(
            item.request_id,
            _prompt_text(prompts[i]),
            item.prompt_token_ids,
            item.sampling_params,  # type: ignore[arg-type]
            index=k,
        )
        index_of[item.request_id] = j
    finished: list[RequestOutput | None] = [None] * len(items)
    pbar = None
    if use_tqdm and len(index_of) > 1:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(index_of), desc="Processed prompts", dynamic_ncols=True)
    try:
        while engine.has_unfinished_requests():
            core_outputs = [o for o in engine.step() if isinstance(o, EngineCoreOutput)]
            done, to_stop = output_processor.process(core_outputs)
            for request_id, stop_str in to_stop:
                engine.stop_request(request_id, stop_str)
            for out in done:
                finished[index_of[out.request_id]] = out
            if pbar is not None and done:
                pbar.update(len(done))
    except BaseException:
        for request_id in index_of:
            engine.abort_request(request_id)
        raise
    finally:
        if pbar is not None:
            pbar.close()
    return finished
