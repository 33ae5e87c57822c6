"""OpenAI chat-completions request and response bodies.

Request bodies keep the fields they do not declare (``extra="allow"``) so that
:mod:`service.services.request_fields` can refuse each one by name: no field is ignored silently.
``vllm_xargs`` and ``watermarking`` are refused there too: the watermark is set by the gateway
from the caller's identity, never by the request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.schemas.text import SURROGATE_MESSAGE, Text, has_lone_surrogate

MAX_STOP_STRINGS = 4
# how the OpenAPI schema shows a field naming the end user (typed loosely so a bad value is a 400)
END_USER_FIELD_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": 256,
    "description": "a stable identifier of the end user (e.g. an HMAC of the platform's user id)",
}
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(strings: list[str]) -> None:
    """The gateway's limits on a request's stop strings (ValueError naming the rule, for a validator)."""
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
    if any(not s for s in strings):
        raise ValueError("stop sequences must not be empty")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in strings):
        raise ValueError(f"stop sequences are limited to {MAX_STOP_STRING_CHARS} characters")
    if any(has_lone_surrogate(s) for s in strings):
        raise ValueError(SURROGATE_MESSAGE)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text = Field(min_length=1, max_length=256)
    arguments: Text


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="forbid")

    id: Text = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    # ``developer`` is OpenAI's newer name for ``system``: the gateway reads it as a system turn
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only on an assistant turn that made tool calls
    content: str | list[TextPart] | None
    name: Text | None = Field(default=None, max_length=256)
    # an assistant turn's tool calls; a tool turn answers one of them by its id
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1, max_length=128)
    tool_call_id: Text | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("content")
    @classmethod
    def _encodable(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        # checked here rather than on each form, so the error names ``content`` itself
        texts = [] if value is None else [value] if isinstance(value, str) else [part.text for part in value]
        if any(has_lone_surrogate(t) for t in texts):
            raise ValueError(SURROGATE_MESSAGE)
        return value

    @model_validator(mode="after")
    def _turn_shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content may be null only on an assistant message with tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message carries tool_call_id")
        return self

    @property
    def uses_tools(self) -> bool:
        """A turn of a tool-using conversation (a tool result, or an assistant's tool calls)."""
        return self.role == "tool" or self.tool_calls is not None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields chat and text completions share: the model, how much to generate and how."""

    model_config = ConfigDict(extra="allow")

    model: Text = Field(min_length=1, max_length=200)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=8)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # the account's end user (checked by service.end_users.identifier: a 400 names the field)
    safety_identifier: Any = Field(default=None, json_schema_extra=END_USER_FIELD_SCHEMA)
    user: Any = Field(default=None, json_schema_extra=END_USER_FIELD_SCHEMA)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([value] if isinstance(value, str) else (value or []))
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The token budget the client asked for (None: the gateway's default) and its field."""
        return self.max_tokens, "max_tokens"


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:  # it wins when both are given
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # OpenAI tool calls ({"id", "type": "function", "function": {"name", "arguments"}}), vLLM backend
    tool_calls: list[dict[str, Any]] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} when the request asked for logprobs
    logprobs: dict[str, Any] | None = None
    # the stop string that ended the choice, if one did: not part of OpenAI's wire format (read by
    # the routes of other protocols, e.g. Anthropic's ``stop_sequence``)
    stop_sequence: str | None = Field(default=None, exclude=True)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    # as ``Choice.stop_sequence``, on the entry that carries the finish reason (never sent)
    stop_sequence: str | None = Field(default=None, exclude=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
