"""OpenAI Responses API bodies (``POST /v1/responses``): the core a text model can honour.

A response is a chat completion under another shape: one assistant message made of one
``output_text`` part, generated under the caller's watermark and recorded like any completion
(``service.routers.responses`` translates the request into a chat request). The wire shapes follow
the official ``openai`` package's ``types/responses`` so that its client parses every field and
computes ``response.output_text`` itself (``output_text`` is not part of the wire format).

Request bodies keep the fields they do not declare (``extra="allow"``), as chat's do, so that the
router can refuse each field it does not honour by name; input items and content parts are typed
loosely (``type: str``) for the same reason: an ``input_image`` part or a ``function_call_output``
item is refused by name (400 ``unsupported_parameter``), not reported as a schema mismatch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.schemas.chat import END_USER_FIELD_SCHEMA
from service.schemas.text import Text

# OpenAI's limits on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512
MetadataKey = Annotated[Text, Field(max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]

# the content parts whose text the model reads: what the client sent, and what the model answered
# earlier in the conversation (a client without server-side state replays it)
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})


class InputContentPart(BaseModel):
    """A part of an input message's content; only text parts are taken (``TEXT_PART_TYPES``)."""

    model_config = ConfigDict(extra="allow")

    type: Text = Field(max_length=64)
    text: Text | None = None


class InputMessage(BaseModel):
    """An input item. Only messages are taken: ``type`` absent (OpenAI's "easy input message") or
    ``"message"``; ``role`` and ``content`` are checked by the router once ``type`` is known, so
    that another item type is named rather than reported as missing a role."""

    model_config = ConfigDict(extra="allow")

    type: Text = Field(default="message", max_length=64)
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Text | list[InputContentPart] | None = None


class ResponseRequest(BaseModel):
    """``POST /v1/responses``. Only these fields are honoured; every other field is refused by
    name unless it is sent at the value that means "off" (``service.routers.responses``)."""

    model_config = ConfigDict(extra="allow")

    model: Text = Field(min_length=1, max_length=200)
    # a list must hold a message (checked by the router, so that the error names 'input' itself)
    input: Text | list[InputMessage]
    # a system message placed before the input
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    # the account's end user the answer is watermarked for (checked by service.end_users.identifier)
    safety_identifier: Any = Field(default=None, json_schema_extra=END_USER_FIELD_SCHEMA)
    user: Any = Field(default=None, json_schema_extra=END_USER_FIELD_SCHEMA)
    # a label: no effect on the output
    metadata: Metadata | None = None


# -- the response object -------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    # the gateway has no prompt cache: nothing is read from or written to one
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a streamed response failed after it started (``response.failed``). ``code`` is one of
    OpenAI's: ``rate_limit_exceeded`` or ``server_error``."""

    code: Literal["server_error", "rate_limit_exceeded"]
    message: str


class TextFormat(BaseModel):
    type: Literal["text"] = "text"


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponseObject(BaseModel):
    """OpenAI's ``Response``. The settings it echoes are the ones the answer was generated with
    (``temperature`` and ``top_p`` with the gateway's defaults filled in); ``store`` is always
    false: nothing can be retrieved by ``id`` later."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: None = None
    store: Literal[False] = False
    temperature: float
    top_p: float
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto"] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    service_tier: Literal["default"] = "default"
    usage: ResponseUsage | None = None
    safety_identifier: str | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


# -- streamed events (``event:`` is the ``type``; ``sequence_number`` counts from 0) ---------------


class ResponseLifecycleEvent(BaseModel):
    """The response as it stands: at the start, and its terminal state."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputMessage


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


ResponseStreamEvent = (
    ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | OutputTextDeltaEvent | OutputTextDoneEvent
)
