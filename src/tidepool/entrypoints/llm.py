"""The offline API, mirroring vLLM's `LLM`: embed, classify, score, encode; generate, chat.

A thin wrapper over the engine driver (engine/llm_engine.py): it turns prompts into requests,
runs them with `LLMEngine.run_batch`, and converts the outputs; scoring rules live in
engine/pooling.py, shared with the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tidepool.checkpoint.loader import DEFAULT_MODEL
from tidepool.config import ModelConfig
from tidepool.engine.args import (
    CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineArgs,
    build_engine_config,
    engine_args_from_vllm,
)
from tidepool.engine.chunked import ChunkedInput, combine, expand, has_chunks
from tidepool.engine.engine_core import EngineCore, EngineMetrics
from tidepool.engine.generate_inputs import eos_token_ids
from tidepool.engine.generation_stream import GenerationInput
from tidepool.engine.input_processor import InputProcessor
from tidepool.engine.llm_engine import LLMEngine
from tidepool.engine.pooling import cross_encoder_score, expand_score_pairs, scoring_rule
from tidepool.engine.prompts import check_prompt_name
from tidepool.engine.prompts import prompt_text as model_prompt
from tidepool.engine.tasks import check_task_supported
from tidepool.engine.tokenization_kwargs import tokenization_options, without_special_tokens
from tidepool.entrypoints.content_parts import score_inputs, split_score_side
from tidepool.entrypoints.llm_inputs import (
    PromptsArg,
    ScoreInputs,
    _as_list,
    _no_lora,
    check_score_chat_template,
    score_tokenization,
)
from tidepool.entrypoints.llm_outputs import completions, prompt_text
from tidepool.entrypoints.llm_scoring import (
    check_score_prompts,
    prompted_pairs,
    score_by_embedding,
    score_by_late_interaction,
)
from tidepool.outputs import (
    BatchInputError,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestError,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    SparseEmbeddingRequestOutput,
)
from tidepool.params import PoolingParams, SamplingParams, check_pooling_task
from tidepool.request import Request
from tidepool.signatures import fields_as_keywords
from tidepool.utils.lists import filled

__all__ = [
    "CAUSAL_DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "ENCODER_DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "LLM",
    "EngineArgs",
    "build_engine_config",
]


class LLM:
    """An engine for offline use. `LLM()` loads the bundled default all-MiniLM-L6-v2."""

    @fields_as_keywords(EngineArgs)
    def __init__(self, model: str | None = DEFAULT_MODEL, **kwargs: Any) -> None:
        """`kwargs`: the fields of `EngineArgs`; every other vLLM argument is refused with the
        reason or, where harmless (enforce_eager, ...), accepted with a warning that it has no
        effect (engine/vllm_args.py). Causal models keep a paged KV cache:
        `kv_cache_memory_bytes` sizes it in bytes, `kv_cache_memory_fraction` as the share of the
        device's memory the process may use (the cache gets what the model leaves); neither:
        4 GiB on CPU (at most a quarter of the free memory), `gpu_memory_utilization` (default
        0.9) on a GPU. Sliding-window layers keep only the blocks inside their window unless
        `disable_hybrid_kv_cache_manager` is set."""
        self.config = engine_args_from_vllm(kwargs).to_engine_config(model)
        self.input_processor = InputProcessor(self.config.model)
        self.llm_engine = LLMEngine(
            self.config,
            detokenizer=self.input_processor.tokenizer,
            multi_vector=self.input_processor.multi_vector,
        )
        self._eos_token_ids = eos_token_ids(self.config.model, self.input_processor.tokenizer)

    # ------------------------------------------------------------------ helpers

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def engine(self) -> EngineCore:
        """The engine core (its scheduler, KV-cache manager, model runner, stats)."""
        return self.llm_engine.core

    def get_tokenizer(self):
        return self.input_processor.tokenizer

    def _params_list(
        self,
        num: int,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        task: str,
        truncate_prompt_tokens: int | None,
        keep_own_task: bool = False,
        prompt_name: str | None = None,
    ) -> list[PoolingParams]:
        """One PoolingParams per prompt with the call's task; the call's truncate_prompt_tokens
        and prompt_name (checked: ValueError naming the model's prompts) override theirs."""
        check_prompt_name(self.model_config, prompt_name)
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
            p = p.with_task(p.task if keep_own_task and p.task else task)  # type: ignore[arg-type]
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
                p.__post_init__()
            if prompt_name is not None:
                p.prompt_name = prompt_name
            out.append(p)
        return out

    def _run(
        self, items: Sequence[Request | RequestError | ChunkedInput], use_tqdm: bool
    ) -> tuple[list[PoolingRequestOutput | None], list[RequestError]]:
        """Run every request; per-prompt errors are returned, never raised. Long inputs run
        in chunks whose outputs are combined (engine/chunked.py)."""
        if has_chunks(items):
            expansion = expand(items)
            flat_results, flat_errors = self._run(expansion.flat, use_tqdm)
            return combine(expansion, flat_results, flat_errors, self.model_config)
        errors = [item for item in items if isinstance(item, RequestError)]
        # Longest first: each step then packs sequences of similar length (cheaper attention).
        requests = sorted(
            ((i, item) for i, item in enumerate(items) if isinstance(item, Request)),
            key=lambda pair: -pair[1].num_prompt_tokens,
        )
        outputs, rejected = self.llm_engine.run_batch([r for _, r in requests], use_tqdm)
        results: list[PoolingRequestOutput | None] = [None] * len(items)
        for (i, _), out, why in zip(requests, outputs, rejected, strict=True):
            if why is not None:
                errors.append(RequestError(i, why))
            else:
                assert isinstance(out, PoolingRequestOutput)  # pooling requests in
                results[i] = out
        errors.sort(key=lambda e: e.index)
        return results, errors

    def _encode_raw(
        self,
        prompts: PromptsArg,
        task: str,
        pooling_params,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        keep_own_task: bool = False,
        *,
        prompt_name: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[PoolingRequestOutput | None], list[RequestError]]:
        prompt_list = _as_list(prompts)
        options = tokenization_options(tokenization_kwargs, truncate_prompt_tokens)
        params = self._params_list(
            len(prompt_list),
            pooling_params,
            task,
            options.truncate_prompt_tokens,
            keep_own_task,
            prompt_name,
        )
        if options.truncation_side is not None:
            params = [replace(p, truncation_side=options.truncation_side) for p in params]
        if not options.add_special_tokens:
            if self.model_config.multi_vector is not None:
                raise ValueError("add_special_tokens=False is not supported on ColBERT models")
            check_prompt_name(self.model_config, prompt_name)
            prefix = model_prompt(self.model_config, prompt_name)
            lower = self.model_config.st.do_lower_case
            prompt_list = without_special_tokens(self.get_tokenizer(), prompt_list, prefix, lower)
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
        prompt_name: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_request: None = None,
    ) -> list[PoolingRequestOutput]:
        """Raw pooler outputs (`outputs.data`, a tensor); `pooling_task` as vLLM's, or
        "embed_sparse" (a sparse [vocab] tensor of token id → weight; `embed_sparse()` gives
        them as lists); a ColBERT model's default is token_embed (one normalized vector per kept
        token). Without `pooling_task`, a PoolingParams that names its task keeps it (one call
        may mix tasks: BGE-M3's dense, sparse and multi-vector in one batch). `prompt_name`: the
        model's prompt put before each text (engine/prompts.py); on a ColBERT model "query" or
        "document" (the default) chooses how the texts are encoded."""
        _no_lora(lora_request)
        if pooling_task is not None:
            check_pooling_task(pooling_task)
        task = pooling_task or self.model_config.default_pooling_task
        results, errors = self._encode_raw(
            prompts,
            task,
            pooling_params,
            truncate_prompt_tokens,
            use_tqdm,
            pooling_task is None,
            prompt_name=prompt_name,
            tokenization_kwargs=tokenization_kwargs,
        )
        return self._finish(results, errors, lambda r: r)

    def embed(
        self,
        prompts: PromptsArg,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        prompt_name: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_request: None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt. `prompt_name`: one of the model's prompts
        (config_sentence_transformers.json), put before each text as sentence-transformers
        does: `llm.embed(queries, prompt_name="query")`; None: its default_prompt_name."""
        _no_lora(lora_request)
        check_task_supported(self.model_config, "embed")
        results, errors = self._encode_raw(
            prompts,
            "embed",
            pooling_params,
            truncate_prompt_tokens,
            use_tqdm,
            prompt_name=prompt_name,
            tokenization_kwargs=tokenization_kwargs,
        )
        return self._finish(results, errors, EmbeddingRequestOutput.from_base)

    def embed_sparse(
        self,
        prompts: PromptsArg,
        *,
        max_active_dims: int | None = None,
        return_tokens: bool = False,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        prompt_name: str | None = None,
    ) -> list[SparseEmbeddingRequestOutput]:
        """Sparse embeddings of a SPLADE or BGE-M3 model: (token id, weight) pairs per prompt
        (`outputs.indices`, `outputs.values`; `outputs.tokens` the tokens as strings with
        `return_tokens`). `max_active_dims` keeps the largest weights only (top-k);
        `prompt_name` as in `embed`."""
        check_task_supported(self.model_config, "embed_sparse")
        if max_active_dims is not None:
            base = pooling_params if isinstance(pooling_params, PoolingParams) else None
            if pooling_params is not None and base is None:
                raise ValueError("give max_active_dims or a list of pooling_params, not both")
            pooling_params = replace(base or PoolingParams(), max_active_dims=max_active_dims)
        results, errors = self._encode_raw(
            prompts,
            "embed_sparse",
            pooling_params,
            truncate_prompt_tokens,
            use_tqdm,
            prompt_name=prompt_name,
        )
        tokenizer = self.get_tokenizer() if return_tokens else None
        return self._finish(
            results, errors, lambda r: SparseEmbeddingRequestOutput.from_base(r, tokenizer)
        )

    def classify(
        self,
        prompts: PromptsArg,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_request: None = None,
    ) -> list[ClassificationRequestOutput]:
        _no_lora(lora_request)
        check_task_supported(self.model_config, "classify")
        results, errors = self._encode_raw(
            prompts,
            "classify",
            pooling_params,
            truncate_prompt_tokens,
            use_tqdm,
            tokenization_kwargs=tokenization_kwargs,
        )
        return self._finish(results, errors, ClassificationRequestOutput.from_base)

    def score(
        self,
        data_1: ScoreInputs,
        data_2: ScoreInputs,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        prompt_name: str | None = None,
        document_prompt_name: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        lora_request: None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: 1-to-N when data_1 has one item, else N-to-N.

        A cross-encoder reads each pair together; a ColBERT model scores MaxSim of the query's
        and the document's token vectors (data_1 encoded as queries, data_2 as documents); an
        embedding model scores the cosine of the two embeddings. `prompt_name` /
        `document_prompt_name`: one of the model's prompts for the data_1 / data_2 side
        (sentence-transformers' encode_query / encode_document, CrossEncoder.predict's
        prompt_name before the first text; see entrypoints/llm_scoring.py). An item may be
        vLLM's {"content": [{"type": "image_url", "image_url": {"url": ...}}, {"type": "text",
        "text": ...}]} (an image document; entrypoints/content_parts.py), on a model that takes
        images.
        """
        _no_lora(lora_request)
        check_score_chat_template(chat_template)
        truncate_prompt_tokens, pooling_params = score_tokenization(
            tokenization_kwargs, truncate_prompt_tokens, pooling_params
        )
        check_task_supported(self.model_config, "score")
        check_score_prompts(self.model_config, prompt_name, document_prompt_name)
        mc = self.model_config
        pairs = expand_score_pairs(
            *(
                score_inputs(
                    _as_list(split_score_side(data), name), name, mc, mc.model, self.config.media
                )
                for data, name in ((data_1, "data_1"), (data_2, "data_2"))
            )
        )
        rule = scoring_rule(mc.task, mc.multi_vector is not None, mc.default_pooling_task)

        def encode(texts: list[Any], task: str, name: str | None):
            return self._encode_raw(
                texts, task, pooling_params, truncate_prompt_tokens, use_tqdm, prompt_name=name
            )

        if rule == "late_interaction":
            if mc.multi_vector is None:  # a token_embed model: the caller's prompts
                return score_by_late_interaction(pairs, encode, prompt_name, document_prompt_name)
            return score_by_late_interaction(pairs, encode)
        if rule == "cosine":
            return score_by_embedding(pairs, encode, prompt_name, document_prompt_name)
        params = self._params_list(len(pairs), pooling_params, "score", truncate_prompt_tokens)
        pairs = prompted_pairs(self.model_config, pairs, prompt_name, document_prompt_name)
        items = self.input_processor.process_pairs(pairs, params)
        results, errors = self._run(items, use_tqdm)
        return self._finish(
            results,
            errors,
            lambda r: ScoringRequestOutput(
                r.request_id, r.prompt_token_ids, ScoringOutput(cross_encoder_score(r.outputs.data))
            ),
        )

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
        """One RequestOutput per prompt, in prompt order; n > 1 completions run as n requests
        (their prompt blocks shared by the prefix cache). Invalid prompts raise BatchInputError
        after the others ran (its `outputs` hold their results)."""
        if self.model_config.runner_type != "generate":
            raise ValueError(
                f"generate() needs a generative model; {self.model_config.architecture} is a "
                f"{self.model_config.task} model (load a *ForCausalLM, or runner='generate')"
            )
        children = completions(len(prompts), sampling_params)
        items = self.input_processor.process_generate(
            [prompts[i] for i, _, _ in children],
            [p for _, _, p in children],
            self._eos_token_ids,
            add_special_tokens=add_special_tokens,
        )
        requests = [(j, item) for j, item in enumerate(items) if isinstance(item, Request)]
        accepted = [j for j, _ in requests]
        inputs = [
            GenerationInput(item, prompt_text(prompts[children[j][0]]), children[j][1])
            for j, item in requests
        ]
        outputs, rejected = self.llm_engine.run_batch(inputs, use_tqdm)
        results: list[RequestOutput | None] = [None] * len(prompts)
        errors: dict[int, str] = {}
        for j, item in enumerate(items):
            if isinstance(item, RequestError):
                errors.setdefault(children[j][0], item.message)
        for j, out, why in zip(accepted, outputs, rejected, strict=True):
            i = children[j][0]
            if why is not None:
                errors.setdefault(i, why)
            else:
                assert isinstance(out, RequestOutput)  # generating requests in
                if (first := results[i]) is None:
                    results[i] = out
                else:
                    first.outputs.extend(out.outputs)
        for result in results:
            if result is not None:
                result.outputs.sort(key=lambda c: c.index)
        if errors:
            raise BatchInputError([RequestError(i, m) for i, m in sorted(errors.items())], results)
        return filled(results)
