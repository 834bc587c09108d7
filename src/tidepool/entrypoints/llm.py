"""The offline API, mirroring vLLM's `LLM`: embed, classify, score, encode; generate, chat."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from tidepool import envs
from tidepool.config import CacheConfig, EngineConfig, SchedulerConfig
from tidepool.engine.engine_core import EngineCore, EngineMetrics
from tidepool.engine.input_processor import InputProcessor
from tidepool.entrypoints.generation import run_generation
from tidepool.models.loader import DEFAULT_MODEL
from tidepool.models.resolve import build_model_config
from tidepool.outputs import (
    BatchInputError,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestError,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request
from tidepool.signatures import fields_as_keywords

logger = logging.getLogger("tidepool")

ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096

# vLLM arguments that mean nothing here; accepted (and ignored) so code ports unchanged.
_IGNORED_VLLM_ARGS = {
    "enforce_eager",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "disable_log_stats",
    "swap_space",
    "task",
}

# Default step budget of causal models (chunked prefill lets prompts exceed it).
CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

PromptsArg = Any  # str | dict | Sequence[str | dict]


def _as_list(prompts: PromptsArg, what: str = "prompts") -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError(f"{what} is empty: give at least one prompt")
        return list(prompts)
    raise TypeError(
        f"{what} must be a string, a dict prompt or a list of them, got {type(prompts).__name__}"
    )


def _set_torch_threads() -> None:
    """TIDEPOOL_NUM_THREADS, else the cores this process may run on (torch's own default counts
    the machine's cores, which oversubscribes a process pinned to fewer, e.g. in a container)."""
    threads = envs.num_threads()
    if threads is None and hasattr(os, "sched_getaffinity"):
        threads = min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """The engine arguments of `LLM(model, **engine_args)` and `AsyncEngine.from_args`: the one
    place that owns their names and defaults."""

    runner: str = "auto"
    """ "pooling", "generate" or "auto" (from the model's architecture)."""
    convert: str = "auto"
    """ "embed" or "classify" turns a pooling model into that task; "auto" keeps its own."""
    dtype: str | torch.dtype = "auto"
    """Weights and activations; "auto": float32 on CPU, the model's 16-bit dtype on a GPU."""
    max_model_len: int | None = None
    """Longest prompt in tokens; None: the model's own limit."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step; None: a default by model kind (see `to_engine_config`)."""
    max_num_seqs: int = 256
    """Most sequences in one engine step."""
    seed: int = 0
    """`torch.manual_seed` when the model runner starts (sampling with no per-request seed)."""
    device: str | None = None
    """ "cpu", "cuda", "cuda:1"...; None: TIDEPOOL_DEVICE, else a GPU where there is one."""
    trust_remote_code: bool = False
    """The transformers backend may run modeling code shipped in the model folder."""
    block_size: int = 16
    """Tokens per KV block (and per prefix-cache hash)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token prefix was computed before."""
    enable_chunked_prefill: bool = True
    """Causal models: a long prompt may run over several steps."""
    long_prefill_token_threshold: int = 0
    """Causal models with chunked prefill: most prompt tokens of one request per step (0: no cap)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache (see `LLM.__init__` for the default)."""
    kv_cache_memory_fraction: float | None = None
    """Share of the device's memory the process may use; the KV cache gets what the model left."""
    disable_hybrid_kv_cache_manager: bool = False
    """Sliding-window layers keep every block like full attention."""
    model_impl: str = "auto"
    """ "native", "transformers" or "auto" (native where tidepool has the architecture)."""

    def to_engine_config(self, model: str) -> EngineConfig:
        _set_torch_threads()
        model_config = build_model_config(
            model,
            convert=self.convert,
            runner=self.runner,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            device=self.device,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            model_impl=self.model_impl,
        )
        # Encoders run each prompt whole; causal models with chunked prefill do not need to.
        whole_prompts = not model_config.is_causal or not self.enable_chunked_prefill
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            if model_config.is_causal:
                max_num_batched_tokens = CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS
            else:
                # Measured (MiniLM, 800 texts, CPU seconds): 4,096-token steps beat 8,192 by 1.1x
                # and 16,384 by 1.3x in float32 (activations stay closer to cache), tie in bfloat16.
                max_num_batched_tokens = ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS
            if whole_prompts:
                max_num_batched_tokens = max(max_num_batched_tokens, model_config.max_model_len)
        elif whole_prompts and max_num_batched_tokens < model_config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_model_len="
                f"{model_config.max_model_len}: "
                + (
                    "an encoder runs each prompt in one step"
                    if not model_config.is_causal
                    else "without chunked prefill a prompt runs in one step"
                )
            )
        return EngineConfig(
            model=model_config,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                memory_fraction=self.kv_cache_memory_fraction,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            ),
        )


_ENGINE_ARG_NAMES = frozenset(f.name for f in fields(EngineArgs))


def build_engine_config(model: str = DEFAULT_MODEL, **engine_args: Any) -> EngineConfig:
    """The engine configuration from `LLM`'s arguments (`EngineArgs`); shared with the server's
    AsyncEngine."""
    return EngineArgs(**engine_args).to_engine_config(model)


def _wants_gpu(device: str | None) -> bool:
    return (device or "").startswith("cuda") or (
        device is None and envs.device() is None and torch.cuda.is_available()
    )


class LLM:
    """An engine for offline use. `LLM()` loads the bundled default all-MiniLM-L6-v2."""

    @fields_as_keywords(EngineArgs)
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        """`kwargs`: the fields of `EngineArgs`, and vLLM arguments that mean nothing here
        (ignored, so vLLM code ports unchanged). Causal models keep a paged KV cache:
        `kv_cache_memory_bytes` sizes it in bytes, `kv_cache_memory_fraction` as the share of the
        device's memory the process may use (the cache gets what the model leaves); neither:
        4 GiB on CPU (at most a quarter of the free memory), `gpu_memory_utilization` (default
        0.9) on a GPU. Sliding-window layers keep only the blocks inside their window unless
        `disable_hybrid_kv_cache_manager` is set."""
        unknown = set(kwargs) - _ENGINE_ARG_NAMES - _IGNORED_VLLM_ARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {sorted(unknown)}")
        ignored = {name: kwargs.pop(name) for name in _IGNORED_VLLM_ARGS & kwargs.keys()}
        engine_args = EngineArgs(**kwargs)
        if (
            engine_args.kv_cache_memory_fraction is None
            and engine_args.kv_cache_memory_bytes is None
            and "gpu_memory_utilization" in ignored
            # vLLM's knob sizes the KV cache on a GPU; on a CPU it means nothing (as in vLLM).
            and _wants_gpu(engine_args.device)
        ):
            memory_fraction = float(ignored.pop("gpu_memory_utilization"))
            engine_args = replace(engine_args, kv_cache_memory_fraction=memory_fraction)
        if ignored:
            logger.info("ignoring vLLM arguments that do not apply here: %s", sorted(ignored))
        self.config = engine_args.to_engine_config(model)
        model_config = self.config.model
        self.engine = EngineCore(self.config)
        self.input_processor = InputProcessor(model_config)

    # ------------------------------------------------------------------ helpers

    @property
    def model_config(self):
        return self.config.model

    def get_tokenizer(self):
        return self.input_processor.tokenizer

    def _params_list(
        self,
        num: int,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        task: str,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingParams]:
        if pooling_params is None:
            params = [PoolingParams()] * num
        elif isinstance(pooling_params, PoolingParams):
            params = [pooling_params] * num
        else:
            params = list(pooling_params)
            if len(params) != num:
                raise ValueError(
                    f"got {len(params)} pooling_params for {num} prompts; give one or one each"
                )
        out = []
        for p in params:
            p = p.with_task(task)  # type: ignore[arg-type]
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
                p.__post_init__()
            out.append(p)
        return out

    def _run(
        self, items: list[Request | RequestError], use_tqdm: bool
    ) -> tuple[list[PoolingRequestOutput | None], list[RequestError]]:
        """Run every request; per-prompt errors are returned, never raised."""
        errors = [item for item in items if isinstance(item, RequestError)]
        results: list[PoolingRequestOutput | None] = [None] * len(items)
        index_of: dict[str, int] = {}
        # Longest first: each step then packs sequences of similar length (cheaper attention).
        order = sorted(
            (i for i, item in enumerate(items) if isinstance(item, Request)),
            key=lambda i: -items[i].num_prompt_tokens,  # type: ignore[union-attr]
        )
        for i in order:
            try:
                self.engine.add_request(items[i])  # type: ignore[arg-type]
            except ValueError as e:
                errors.append(RequestError(i, str(e)))
                continue
            index_of[items[i].request_id] = i  # type: ignore[union-attr]
        num_requests = len(index_of)
        pbar = None
        if use_tqdm and num_requests > 1:
            from tqdm.auto import tqdm

            pbar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[index_of[out.request_id]] = out
                    if pbar is not None:
                        pbar.update(1)
        except BaseException:
            for req_id in index_of:
                self.engine.abort_request(req_id)
            raise
        finally:
            if pbar is not None:
                pbar.close()
        errors.sort(key=lambda e: e.index)
        return results, errors

    def _encode_raw(
        self,
        prompts: PromptsArg,
        task: str,
        pooling_params,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
    ) -> tuple[list[PoolingRequestOutput | None], list[RequestError]]:
        prompt_list = _as_list(prompts)
        params = self._params_list(len(prompt_list), pooling_params, task, truncate_prompt_tokens)
        return self._run(self.input_processor.process(prompt_list, params), use_tqdm)

    @staticmethod
    def _finish(results: list, errors: list[RequestError], convert) -> list:
        converted = [None if r is None else convert(r) for r in results]
        if errors:
            raise BatchInputError(errors, converted)
        return converted

    # ------------------------------------------------------------------ public API

    def encode(
        self,
        prompts: PromptsArg,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Raw pooler outputs (`outputs.data`, a tensor); `pooling_task` as vLLM's."""
        task = pooling_task or ("classify" if self.model_config.task == "classify" else "embed")
        results, errors = self._encode_raw(
            prompts, task, pooling_params, truncate_prompt_tokens, use_tqdm
        )
        return self._finish(results, errors, lambda r: r)

    def embed(
        self,
        prompts: PromptsArg,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        results, errors = self._encode_raw(
            prompts, "embed", pooling_params, truncate_prompt_tokens, use_tqdm
        )
        return self._finish(results, errors, EmbeddingRequestOutput.from_base)

    def classify(
        self,
        prompts: PromptsArg,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        if self.model_config.task != "classify":
            raise ValueError(
                "classify() needs a model with a classification head "
                f"({self.model_config.architecture} is an embedding model)"
            )
        results, errors = self._encode_raw(
            prompts, "classify", pooling_params, truncate_prompt_tokens, use_tqdm
        )
        return self._finish(results, errors, ClassificationRequestOutput.from_base)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: 1-to-N when data_1 has one item, else N-to-N.

        A cross-encoder reads each pair together; an embedding model scores the cosine of the two
        embeddings.
        """
        first = _as_list(data_1, "data_1")
        second = _as_list(data_2, "data_2")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise ValueError(
                f"data_1 has {len(first)} items and data_2 {len(second)}: give one data_1 item "
                "(1-to-N) or as many as data_2 (N-to-N)"
            )
        pairs = list(zip(first, second, strict=True))
        if self.model_config.task == "classify":
            params = self._params_list(len(pairs), pooling_params, "score", truncate_prompt_tokens)
            items = self.input_processor.process_pairs(pairs, params)
            results, errors = self._run(items, use_tqdm)
            return self._finish(
                results,
                errors,
                lambda r: ScoringRequestOutput(
                    r.request_id, r.prompt_token_ids, ScoringOutput(float(r.outputs.data))
                ),
            )
        return self._score_by_embedding(pairs, pooling_params, truncate_prompt_tokens, use_tqdm)

    def _score_by_embedding(self, pairs, pooling_params, truncate_prompt_tokens, use_tqdm):
        # Embed each distinct text once (1-to-N embeds the query once).
        texts: list = []
        slot: dict[Any, int] = {}
        keys = []
        for a, b in pairs:
            pair_keys = []
            for text in (a, b):
                key = text if isinstance(text, str) else id(text)
                if key not in slot:
                    slot[key] = len(texts)
                    texts.append(text)
                pair_keys.append(slot[key])
            keys.append(pair_keys)
        results, text_errors = self._encode_raw(
            texts, "embed", pooling_params, truncate_prompt_tokens, use_tqdm
        )
        failed = {e.index: e.message for e in text_errors}
        errors: list[RequestError] = []
        outputs: list[ScoringRequestOutput | None] = []
        for i, (ka, kb) in enumerate(keys):
            bad = [
                f"{side}: {failed[k]}"
                for side, k in (("data_1", ka), ("data_2", kb))
                if k in failed
            ]
            if bad:
                errors.append(RequestError(i, "; ".join(bad)))
                outputs.append(None)
                continue
            ea, eb = results[ka], results[kb]
            score = F.cosine_similarity(ea.outputs.data, eb.outputs.data, dim=0).item()
            outputs.append(
                ScoringRequestOutput(
                    f"score-{ea.request_id}-{eb.request_id}",
                    ea.prompt_token_ids + eb.prompt_token_ids,
                    ScoringOutput(score if math.isfinite(score) else 0.0),
                )
            )
        if errors:
            raise BatchInputError(errors, outputs)
        return outputs

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptsArg,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completions of each prompt, in prompt order (vLLM's `LLM.generate`).

        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [...]}; texts get the
        tokenizer's special tokens (BOS). Invalid prompts raise BatchInputError after the rest ran.
        """
        return self._generate(_as_list(prompts), sampling_params, use_tqdm, add_special_tokens=True)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...], or a list of
        them), rendered with the tokenizer's chat template."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (a list of dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        texts = [
            tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The template writes the special tokens (BOS) itself.
        return self._generate(texts, sampling_params, use_tqdm, add_special_tokens=False)

    def get_metrics(self) -> EngineMetrics:
        """Running / waiting requests, KV-cache usage, prefix-cache queries and hits (tokens),
        preemptions, prompt and generated tokens, since the engine started."""
        return self.engine.get_metrics()

    def _generate(
        self,
        prompts: list,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        if self.model_config.runner_type != "generate":
            raise ValueError(
                f"generate() needs a generative model; {self.model_config.architecture} is a "
                f"{self.model_config.task} model (load a *ForCausalLM, or runner='generate')"
            )
        return run_generation(
            self.engine,
            self.input_processor,
            prompts,
            sampling_params,
            use_tqdm=use_tqdm,
            add_special_tokens=add_special_tokens,
        )
