"""OpenAI's legacy text completions, ``POST /v1/completions``: the HTTP side.

The generation is the chat route's (admission, limits, watermark, disconnect handling, the
generation record): only the prompt (raw text, no chat template) and the response shapes differ.
Responses are ``text_completion`` objects; ``echo`` puts the prompt in front of each choice's text
(usage and the record count only the generated tokens).
"""

from __future__ import annotations

import functools
import json

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse
from starlette.responses import Response

from service.deps import PrincipalDep
from service.end_users.identifier import openai_identifier
from service.routers.chat import (
    CLIENT_CLOSED_REQUEST,
    CompletionResponse,
    EndUsersDep,
    GenerationDep,
    complete_while_connected,
    for_end_user,
    sse_events,
)
from service.routing import AuthenticatedRoute
from service.schemas.chat import ChatCompletion, ChatCompletionChunk
from service.schemas.common import ERROR_RESPONSES
from service.schemas.completions import CompletionRequest, TextChoice, TextCompletion

router = APIRouter(prefix="/v1", tags=["completions"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)


def text_completion(completion: ChatCompletion, echo: str = "") -> TextCompletion:
    """The chat-shaped result of the generation as a ``text_completion``."""
    return TextCompletion(
        id=completion.id,
        created=completion.created,
        model=completion.model,
        choices=[
            TextChoice(index=c.index, text=echo + (c.message.content or ""), finish_reason=c.finish_reason)
            for c in completion.choices
        ],
        usage=completion.usage,
    )


def text_chunk_payload(chunk: ChatCompletionChunk, *, include_usage: bool, echo: str | None) -> str | None:
    """One chat chunk as a ``text_completion`` chunk; None for a chunk with nothing to say (the
    role announcement, unless it carries the echoed prompt)."""
    choices = []
    for c in chunk.choices:
        if c.delta.role is not None:  # the first chunk of a stream
            if echo is None:
                continue
            choices.append({"index": c.index, "text": echo, "logprobs": None, "finish_reason": None})
            continue
        text = c.delta.content or ""
        choices.append({"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason})
    if not choices and chunk.usage is None:
        return None
    payload = {
        "id": chunk.id,
        "object": "text_completion",
        "created": chunk.created,
        "model": chunk.model,
        "choices": choices,
    }
    if include_usage:
        payload["usage"] = None if chunk.usage is None else chunk.usage.model_dump(mode="json")
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


@router.post(
    "/completions",
    response_model=TextCompletion,
    responses={200: {"content": {"text/event-stream": {}}, "description": "A completion, or SSE chunks"}},
)
async def create_completion(
    body: CompletionRequest, principal: PrincipalDep, service: GenerationDep, end_users: EndUsersDep, request: Request
) -> Response:
    identifier = openai_identifier({"safety_identifier": body.safety_identifier, "user": body.user})
    prepared = await for_end_user(service, end_users, service.prepare_text(principal, body), identifier, request)
    echo = prepared.request.prompt if body.echo else None
    if not body.stream:
        completed = await complete_while_connected(service, prepared, request.receive)
        if completed is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        headers = {"Server-Timing": f"model;dur={completed.model_ms:.3f}"}
        return CompletionResponse(
            text_completion(completed.completion, echo or ""), headers=headers, after=completed.after
        )
    stream = await service.open_stream(prepared)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    render = functools.partial(text_chunk_payload, include_usage=include_usage, echo=echo)
    events = sse_events(service, prepared, stream, include_usage=include_usage, render=render)
    return EventSourceResponse(events, sep="\n", ping=15)
