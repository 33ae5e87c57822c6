"""``POST /v1/embeddings``: the HTTP side (the request's path is ``service.EmbeddingService``'s)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import Response

from service.deps import PrincipalDep, ResourcesDep
from service.embeddings.schemas import EmbeddingList, EmbeddingRequest
from service.embeddings.service import EmbeddingService
from service.routing import AuthenticatedRoute
from service.schemas.common import ERROR_RESPONSES

router = APIRouter(prefix="/v1", tags=["embeddings"], responses=ERROR_RESPONSES, route_class=AuthenticatedRoute)


async def _embeddings(resources: ResourcesDep) -> EmbeddingService:
    # No request-wide unit of work: the usage record commits on its own.
    return EmbeddingService(
        models=resources.embeddings,
        chat=resources.fleet,
        records=resources.embedding_records,
        settings=resources.settings,
        admission=resources.admission,
        metrics=resources.metrics,
        telemetry=resources.telemetry,
    )


EmbeddingServiceDep = Annotated[EmbeddingService, Depends(_embeddings)]


@router.post("/embeddings", response_model=EmbeddingList)
async def create_embeddings(body: EmbeddingRequest, principal: PrincipalDep, service: EmbeddingServiceDep) -> Response:
    """Embed a text or a list of texts with an embedding model (no watermark: an embedding is not
    generated text). Counted in the caller's usage and limits like a chat request's prompt."""
    embeddings = await service.create(principal, body)
    return Response(embeddings.model_dump_json().encode(), media_type="application/json")
