"""Anthropic Messages API bodies (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

A message is a chat completion under another shape: ``service.routers.messages`` translates the
request into a chat request, and the answer is generated under the caller's watermark and recorded
like any completion. The wire shapes follow the official ``anthropic`` package's ``types`` so that
its client parses every field, streamed or not.

Request bodies keep the fields they do not declare (``extra="allow"``), as chat's do, so that the
router can refuse each field it does not honour by name; content blocks and tools are typed
loosely (``type: str``) for the same reason: an ``image`` block or a server tool is refused by
name (400 ``invalid_request_error`` naming the field), not reported as a schema mismatch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.schemas.chat import END_USER_FIELD_SCHEMA, check_stop_strings
from service.schemas.text import Text

# the most tools a request may define (OpenAI's limit, which the vLLM workers share)
MAX_TOOLS = 128


class CacheControl(BaseModel):
    """A prompt-caching breakpoint. The gateway caches no prompts, and caching never changes an
    answer: it is accepted, and the usage reports no token written to or read from a cache."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class ContentBlock(BaseModel):
    """A block of a message's content (or of a tool result's). The fields are those of the block
    types the gateway takes: ``text``; ``tool_use`` (an assistant's call: ``id``, ``name``,
    ``input``); ``tool_result`` (the caller's answer to one: ``tool_use_id``, ``content``,
    ``is_error``). The router checks which belong to the block's ``type``."""

    model_config = ConfigDict(extra="allow")

    type: Text = Field(max_length=64)
    text: Text | None = None
    id: Text | None = Field(default=None, min_length=1, max_length=256)
    name: Text | None = Field(default=None, min_length=1, max_length=256)
    # any JSON value: an object as Anthropic's API writes it, or the text the gateway returned as
    # ``input`` when the model's arguments were not JSON (sent back as they came)
    input: Any = None
    tool_use_id: Text | None = Field(default=None, min_length=1, max_length=256)
    content: Text | list[ContentBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class ToolParam(BaseModel):
    """A tool the model may call: a custom tool (``type`` absent or ``"custom"``) with its JSON
    schema. Anthropic's server tools (``web_search_...``, ``bash_...``) are refused by name."""

    model_config = ConfigDict(extra="allow")

    type: Text | None = Field(default=None, max_length=64)
    name: Text = Field(min_length=1, max_length=128)
    description: Text | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = Field(default=None, min_length=1, max_length=128)
    disable_parallel_tool_use: bool | None = None


class RequestMetadata(BaseModel):
    """Anthropic's ``metadata``: ``user_id`` names the account's end user the answer is watermarked
    for (checked by ``service.end_users.identifier``: a bad value is a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    user_id: Any = Field(default=None, json_schema_extra=END_USER_FIELD_SCHEMA)


class MessagesPrompt(BaseModel):
    """What a prompt is made of: the body of ``POST /v1/messages/count_tokens``."""

    model_config = ConfigDict(extra="allow")

    model: Text = Field(min_length=1, max_length=200)
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | list[ContentBlock] | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # a cache breakpoint for the whole request (see CacheControl)
    cache_control: CacheControl | None = None


class MessagesRequest(MessagesPrompt):
    """``POST /v1/messages``. Only these fields are honoured; every other field is refused by name
    unless it is sent at the value that means "off" (``service.routers.messages``)."""

    # required, as Anthropic requires it
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    # Anthropic's ranges
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: RequestMetadata | None = None
    stream: bool | None = False

    @field_validator("stop_sequences")
    @classmethod
    def _stop_strings(cls, value: list[str] | None) -> list[str] | None:
        check_stop_strings(value or [])
        return value


# -- the message object ----------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    # the JSON object of the call's arguments; what the model wrote when it wrote no object
    # (``service.routers.messages._tool_input``)
    input: Any


OutputBlock = TextBlock | ToolUseBlock


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    # the gateway has no prompt cache: nothing is written to or read from one
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    """Anthropic's ``Message``: the assistant's answer. ``stop_sequence`` is the stop string that
    ended it (``stop_reason`` ``stop_sequence``); ``stop_reason`` is null only while it streams."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    """The answer of ``POST /v1/messages/count_tokens``."""

    input_tokens: int


# -- streamed events (``event:`` is the ``type``) -------------------------------------------------


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageObject


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    """A piece of a tool call's ``input``, as JSON text (the pieces concatenate to the object)."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    """The usage at the end of the stream (cumulative)."""

    input_tokens: int
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class AnthropicErrorDetail(BaseModel):
    """``type``: ``invalid_request_error``, ``authentication_error``, ``permission_error``,
    ``not_found_error``, ``request_too_large``, ``rate_limit_error``, ``api_error``,
    ``overloaded_error`` or ``timeout_error`` (``service.errors.ANTHROPIC_STATUSES``)."""

    type: str
    message: str


class AnthropicErrorEnvelope(BaseModel):
    """Anthropic's error body: the answer of an error on these routes, and a stream's ``error``
    event when the generation fails after the stream started."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


MessageStreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | PingEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | AnthropicErrorEnvelope
)

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field out of range or not honoured (named), a body that does not match the schema",
    401: "Missing or invalid API key (x-api-key or Authorization: Bearer)",
    403: "The key's user is disabled or deleted",
    404: "No such model",
    413: "The request body is too large",
    429: "A limit of the caller or the gateway's queue (see Retry-After)",
    500: "An internal error or a model failure",
    503: "The database, the model or the workers are unavailable (see Retry-After)",
    504: "The request deadline passed",
}

# Every error these routes answer, in Anthropic's envelope, as documented in the OpenAPI schema.
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": AnthropicErrorEnvelope, "description": description}
    for status, description in _ERROR_DESCRIPTIONS.items()
}
