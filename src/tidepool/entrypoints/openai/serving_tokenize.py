"""/tokenize, /detokenize and the chat template (for /tokenize and /v1/chat/completions): the
routes that only need the tokenizer, always on the tokenizer thread."""

from __future__ import annotations

from typing import Any

from tidepool.entrypoints.openai import protocol as p
from tidepool.entrypoints.openai.errors import ApiError
from tidepool.entrypoints.openai.inputs import (
    check_messages,
    check_request_chat_template,
    check_strings,
    check_text,
)
from tidepool.entrypoints.openai.serving import OpenAIServing


class OpenAIServingTokenization:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    async def render_chat(
        self,
        messages: list[Any],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Chat messages → the prompt text, by the tokenizer's chat template (or `chat_template`)."""
        trusted = self.serving.limits.trust_request_chat_template
        check_request_chat_template(chat_template, chat_template_kwargs, trusted)
        messages = check_messages(messages)
        check_strings(chat_template, "chat_template", "chat_template")
        check_strings(chat_template_kwargs, "chat_template_kwargs", "chat_template_kwargs")
        chat_template_kwargs = dict(chat_template_kwargs or {})
        if chat_template is None:  # vLLM reads a template given among the keywords too
            chat_template = chat_template_kwargs.pop("chat_template", None)
        chat_template_kwargs.pop("chat_template", None)
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ApiError(
                400,
                "The model's tokenizer has no chat template, so the messages cannot be turned "
                "into a prompt: pass a Jinja template as `chat_template` in the request, or send "
                "a prompt instead",
                "messages",
            )

        def render() -> str:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )

        try:
            prompt = await self.engine.run_in_tokenizer(render)
        except Exception as e:  # jinja2 errors, transformers' ValueErrors, bad kwargs
            message = f"the chat template failed on these messages: {type(e).__name__}: {e}"
            raise ApiError(400, message, "messages") from e
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "the chat template rendered an empty prompt", "messages")
        return check_text(prompt, "the rendered chat prompt", "messages")

    async def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        self.serving.model_name(req.model)
        for name in ("tools", "mm_processor_kwargs", "media_io_kwargs"):
            if getattr(req, name):
                what = "tool calling" if name == "tools" else "multimodal inputs (text models only)"
                raise ApiError(400, f"{name} is not supported here: there is no {what}", name)
        add_special_tokens = req.add_special_tokens
        prompt = req.prompt
        if req.messages is not None:
            prompt = await self.render_chat(
                req.messages,
                req.chat_template,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
            )
            add_special_tokens = False  # the template writes them (as in /v1/chat/completions)
        if prompt is None:
            raise ApiError(400, "give 'prompt' (a string) or 'messages' to tokenize", "prompt")
        check_text(prompt, "prompt", "prompt")
        tokenizer = self.engine.tokenizer

        def run() -> tuple[list[int], list[str] | None]:
            ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            return ids, tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

        ids, strs = await self.engine.run_in_tokenizer(run)
        return p.TokenizeResponse(
            count=len(ids),
            max_model_len=self.engine.model_config.max_model_len,
            tokens=ids,
            token_strs=strs,
        )

    async def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.serving.model_name(req.model)
        tokenizer = self.engine.tokenizer

        def run() -> str:
            # Even len() reads the Rust tokenizer: only the tokenizer thread may touch it.
            vocab_size = len(tokenizer)
            for token in req.tokens:
                if not 0 <= token < vocab_size:
                    message = f"token id {token} is outside the vocabulary [0, {vocab_size})"
                    raise ApiError(400, message, "tokens")
            return tokenizer.decode(req.tokens)

        return p.DetokenizeResponse(prompt=await self.engine.run_in_tokenizer(run))
