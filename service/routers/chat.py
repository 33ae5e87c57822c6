"""OpenAI-compatible chat completions and model listing."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from service.deps import PrincipalDep
from service.routing import AuthenticatedRoute
from service.schemas.chat import ChatCompletion, ChatCompletionRequest, ModelList
from service.schemas.common import ERROR_RESPONSES
from service.services.generation import CompletionResponse, GenerationService

router = APIRouter(prefix="/v1", tags=["chat"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)


async def _generation(request: Request) -> GenerationService:
    # No request-wide unit of work: the generation record commits on its own. One dependency
    # reading the app's state (rather than one per resource) keeps FastAPI's per-request work small.
    state = request.app.state
    return GenerationService(state.generation_records, state.settings, state.backend, state.keyring, state.metrics)


GenerationDep = Annotated[GenerationService, Depends(_generation)]


@router.get("/models", response_model=ModelList)
async def list_models(_: PrincipalDep, service: GenerationDep) -> ModelList:
    return service.list_models()


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
    body: ChatCompletionRequest, principal: PrincipalDep, service: GenerationDep
) -> CompletionResponse | EventSourceResponse:
    prepared = service.prepare(principal, body)
    if not body.stream:
        return await service.complete(prepared)
    stream = await service.open_stream(prepared)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return EventSourceResponse(service.sse_events(prepared, stream, include_usage=include_usage), sep="\n", ping=15)
