"""OpenAI (legacy) text-completions request and response bodies: ``POST /v1/completions``.

The prompt is continued as it is, without the chat template, under the caller's watermark like a
chat completion. One text prompt per request; token-id prompts, ``suffix``, ``best_of`` > 1 and
``logprobs`` are refused by name (``service.services.request_fields``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from service.errors import InvalidRequestError
from service.schemas.chat import SamplingRequest, Usage
from service.schemas.text import Text

# OpenAI's default max_tokens for this endpoint (chat's default is the gateway's limit)
TEXT_COMPLETION_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingRequest):
    # a list (of strings or token ids) is accepted by the type and refused in prompt_text by name
    prompt: Text | list[Text] | list[int] | list[list[int]]
    # the answer's text starts with the prompt (the usage and the record count only what was generated)
    echo: bool | None = False

    def prompt_text(self) -> str:
        """The one text prompt; 400 naming ``prompt`` for what the gateway does not take."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("'prompt' must not be empty", param="prompt", code="invalid_value")
            return prompt
        if prompt and all(isinstance(p, str) for p in prompt):
            message = "one prompt per request: send each prompt in a request of its own"
        else:
            message = "token-id prompts are not supported; send the prompt as text"
        raise InvalidRequestError(f"'prompt': {message}", param="prompt", code="unsupported_parameter")


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
