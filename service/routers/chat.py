"""OpenAI-compatible chat completions, model listing and retrieval: the HTTP side (JSON body, SSE stream).

A client that disconnects stops its generation, streamed or not: the SSE response notices it
while sending; a non-streamed request is generated in a task of its own while this side listens
for the disconnect, and cancels the task when it comes (the choices are recorded as ``cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Annotated, Protocol

import anyio
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.backends.base import GenerationStream
from service.deps import PrincipalDep, ResourcesDep
from service.end_users.directory import EndUserDirectory
from service.end_users.identifier import openai_identifier
from service.errors import GatewayError, NotFoundError, envelope
from service.routing import AuthenticatedRoute
from service.schemas.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ModelCard, ModelList
from service.schemas.common import ERROR_RESPONSES
from service.services.generation import CompletedChat, GenerationService, PreparedCompletion

# the status logged for a request whose client went away before its response (nginx's convention);
# nobody receives it
CLIENT_CLOSED_REQUEST = 499

router = APIRouter(prefix="/v1", tags=["chat"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)


class CompletionResponse(Response):
    """A non-streamed completion as JSON. ``after`` runs once the response has been handed to the
    server, also when sending failed or the request was cancelled meanwhile (shielded)."""

    media_type = "application/json"

    def __init__(
        self,
        completion: BaseModel,
        *,
        headers: dict[str, str],
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(completion.model_dump_json().encode(), headers=headers)
        self._after = after

    @classmethod
    def of(
        cls, completed: CompletedChat, render: Callable[[ChatCompletion], BaseModel] | None = None
    ) -> CompletionResponse:
        """The completion (or what ``render`` makes of it: a response, a message) with its timing."""
        # the backend's share of the request (W3C Server-Timing): the rest is the gateway's
        headers = {"Server-Timing": f"model;dur={completed.model_ms:.3f}"}
        body = completed.completion if render is None else render(completed.completion)
        return cls(body, headers=headers, after=completed.after)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._after is not None:
                with anyio.CancelScope(shield=True):
                    await self._after()


def sse_payload(chunk: ChatCompletionChunk, *, include_usage: bool) -> str:
    """One chunk as the ``data:`` payload OpenAI clients expect (``usage`` only when asked for)."""
    payload = chunk.model_dump(mode="json", exclude={"choices"})
    if not include_usage:
        payload.pop("usage")
    payload["choices"] = [
        {
            "index": c.index,
            "delta": c.delta.model_dump(mode="json", exclude_none=True),
            "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
        }
        for c in chunk.choices
    ]
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


async def sse_events(
    service: GenerationService,
    prepared: PreparedCompletion,
    stream: GenerationStream,
    *,
    include_usage: bool,
    render: Callable[[ChatCompletionChunk], str | None] | None = None,
) -> AsyncIterator[str]:
    """The ``data:`` payloads of the SSE response, ending with ``[DONE]`` (or an error envelope).
    ``render`` turns a chunk into its payload (None: nothing to send); chat's shape by default."""
    async with contextlib.aclosing(service.stream_chunks(prepared, stream, include_usage=include_usage)) as chunks:
        async for item in chunks:
            if isinstance(item, GatewayError):
                yield json.dumps(envelope(item.message, type_=item.type, code=item.code))
            elif isinstance(item, ChatCompletionChunk):
                payload = sse_payload(item, include_usage=include_usage) if render is None else render(item)
                if payload is not None:
                    yield payload
            else:  # EndOfStream
                yield "[DONE]"


class NamedEvent(Protocol):
    """An event of a typed stream (the Responses and Messages APIs): its ``type`` is its SSE name."""

    @property
    def type(self) -> str: ...

    def model_dump_json(self) -> str: ...


class TypedEvents(Protocol):
    """What a typed stream makes of the chunks: the events of each, of its end, of its failure."""

    def chunk(self, chunk: ChatCompletionChunk) -> Sequence[NamedEvent]: ...

    def ended(self) -> Sequence[NamedEvent]: ...

    def failed(self, error: GatewayError) -> Sequence[NamedEvent]: ...


async def typed_sse_events(
    service: GenerationService, prepared: PreparedCompletion, stream: GenerationStream, events: TypedEvents
) -> AsyncIterator[dict[str, str]]:
    """A typed stream's SSE events as sse-starlette sends them (``event:`` its type, ``data:`` its
    JSON). Closing this generator (the client left) closes the chunks' generator, which stops the
    generation and records what was sent."""
    async with contextlib.aclosing(service.stream_chunks(prepared, stream, include_usage=True)) as chunks:
        async for item in chunks:
            if isinstance(item, GatewayError):
                batch = events.failed(item)
            elif isinstance(item, ChatCompletionChunk):
                batch = events.chunk(item)
            else:  # EndOfStream
                batch = events.ended()
            for event in batch:
                yield {"event": event.type, "data": event.model_dump_json()}


async def complete_rendered(
    service: GenerationService,
    prepared: PreparedCompletion,
    request: Request,
    render: Callable[[ChatCompletion], BaseModel],
) -> Response:
    """A non-streamed answer in another API's shape: generated while the client is connected
    (499, unsent, if it leaves), rendered, sent with its timing, recorded after."""
    completed = await complete_while_connected(service, prepared, request.receive)
    if completed is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return CompletionResponse.of(completed, render)


async def _generation(resources: ResourcesDep) -> GenerationService:
    # No request-wide unit of work: the generation record commits on its own.
    return GenerationService(
        resources.generation_records,
        resources.settings,
        resources.fleet,
        resources.keyring,
        resources.metrics,
        admission=resources.admission,
        telemetry=resources.telemetry,
        sketcher=resources.sketcher,
        salt_rotation=resources.salt_rotation,
        end_users=resources.end_users,
    )


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone. The body has been read by now, so the server's next
    message is ``http.disconnect`` (it blocks until then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def complete_while_connected(
    service: GenerationService, prepared: PreparedCompletion, receive: Receive
) -> CompletedChat | None:
    """``service.complete(prepared)``, cancelled if the client disconnects first (then None)."""
    work = asyncio.ensure_future(service.complete(prepared))
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():  # the client left, or this request was cancelled: stop generating
            work.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({work})  # its choices are recorded as cancelled meanwhile
    if work.cancelled():
        return None
    return work.result()


GenerationDep = Annotated[GenerationService, Depends(_generation)]


async def _end_users(resources: ResourcesDep) -> EndUserDirectory:
    return resources.end_users


EndUsersDep = Annotated[EndUserDirectory, Depends(_end_users)]


async def for_end_user(
    service: GenerationService,
    end_users: EndUserDirectory,
    prepared: PreparedCompletion,
    identifier: str | None,
    request: Request,
) -> PreparedCompletion:
    """``prepared`` (validated) generated for the caller's end user ``identifier`` (None: for the
    account itself): the end user is found, or created on first sight, only once the request is
    known to be valid."""
    if identifier is None:
        return prepared
    params = prepared.stamp.key.params
    identity = await end_users.resolve(
        prepared.principal,
        identifier,
        (params.bits, params.block_bits),
        request_id=getattr(request.state, "request_id", None),
    )
    return service.for_end_user(prepared, identity)


@router.get("/models", response_model=ModelList)
async def list_models(_: PrincipalDep, service: GenerationDep) -> ModelList:
    return service.list_models()


# ``path``: a model's name may hold a slash (``org/model``)
@router.get("/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, _: PrincipalDep, service: GenerationDep) -> ModelCard:
    """A served model by its name or one of its aliases (404 ``model_not_found`` otherwise)."""
    if not model:  # "/v1/models/": no model named, no such route (and no redirect)
        raise NotFoundError("Not found", code="not_found")
    return service.model_card(model)


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "A completion, or SSE chunks when stream=true",
        }
    },
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    principal: PrincipalDep,
    service: GenerationDep,
    end_users: EndUsersDep,
    request: Request,
) -> Response:
    identifier = openai_identifier({"safety_identifier": body.safety_identifier, "user": body.user})
    prepared = await for_end_user(service, end_users, service.prepare(principal, body), identifier, request)
    if not body.stream:
        completed = await complete_while_connected(service, prepared, request.receive)
        if completed is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return CompletionResponse.of(completed)
    stream = await service.open_stream(prepared)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    events = sse_events(service, prepared, stream, include_usage=include_usage)
    return EventSourceResponse(events, sep="\n", ping=15)
