"""Liveness, readiness and metrics endpoints (no authentication)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request, Response
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db import ping
from service.deps import MetricsDep, ResourcesDep
from service.errors import ServiceUnavailableError
from service.schemas.common import UNAVAILABLE_RESPONSES

logger = logging.getLogger("xmark.health")

router = APIRouter(tags=["health"], responses=UNAVAILABLE_RESPONSES)

# /readyz answers within this long whatever the database does: a hung database must read as "not
# ready" before an orchestrator's probe times out (commonly 1 to 2 s)
READY_TIMEOUT_S = 1.5


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # read here: a probe nobody waits for any more must not log "never retrieved"


async def _database_answers(request: Request, engine: AsyncEngine) -> bool:
    """Whether the database answers a trivial query within :data:`READY_TIMEOUT_S`.

    The query runs as a task of its own that is not cancelled when the wait ends: cancelling would
    wait for the driver to clean up, on a hung server as long again. It ends by itself within the
    engine's own timeouts; probes arriving meanwhile wait for the same query instead of adding one.
    """
    state = request.app.state
    running: tuple[AsyncEngine, asyncio.Task[None]] | None = getattr(state, "readiness_probe", None)
    if running is not None and running[0] is engine and not running[1].done():
        probe = running[1]
    else:
        probe = asyncio.create_task(ping(engine))
        probe.add_done_callback(_retrieved)
        state.readiness_probe = (engine, probe)
    done, _ = await asyncio.wait({probe}, timeout=READY_TIMEOUT_S)
    if not done:
        logger.warning("database not reachable", extra={"error_type": "TimeoutError"})
        return False
    error = asyncio.CancelledError() if probe.cancelled() else probe.exception()
    if error is not None:  # any driver error means "not ready"
        logger.warning("database not reachable", extra={"error_type": type(error).__name__})
        return False
    return True


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request, resources: ResourcesDep) -> dict[str, object]:
    """Ready when the database answers within 1.5 s and at least one served chat model's backend is
    ready (503 envelope otherwise); the body lists every model's state, embedding models included.
    A model whose backend is down answers 503 for itself only (its requests say so); the others
    keep serving through this replica."""
    if not await _database_answers(request, resources.engine):
        raise ServiceUnavailableError("The database is not reachable", code="database_unavailable")
    models = {
        model.name: "ready" if getattr(model.backend, "ready", False) else "not_ready" for model in resources.fleet
    }
    if "ready" not in models.values():
        raise ServiceUnavailableError("No model backend is ready yet", code="backend_not_ready")
    # the embedding models' states are listed too; readiness is the chat models' (every route but one)
    for embedding in resources.embeddings:
        models[embedding.name] = "ready" if embedding.backend.ready else "not_ready"
    return {"status": "ready", "models": models}


@router.get("/metrics", response_class=Response)
async def metrics(registry: MetricsDep) -> Response:
    """Prometheus text exposition of this process."""
    return Response(content=registry.render(), media_type=registry.content_type)
