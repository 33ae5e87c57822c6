"""Liveness, readiness and metrics endpoints (no authentication)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response

from service.db import ping
from service.deps import MetricsDep, ResourcesDep
from service.errors import ServiceUnavailableError

logger = logging.getLogger("xmark.health")

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(resources: ResourcesDep) -> dict[str, str]:
    """Ready when the database answers and the model backend is ready (503 envelope otherwise)."""
    try:
        await ping(resources.engine)
    except Exception as exc:  # any driver error means "not ready"
        logger.warning("database not reachable", extra={"error_type": type(exc).__name__})
        raise ServiceUnavailableError("The database is not reachable", code="database_unavailable") from None
    if not getattr(resources.backend, "ready", False):
        raise ServiceUnavailableError("The model backend is not ready yet", code="backend_not_ready")
    return {"status": "ready"}


@router.get("/metrics", response_class=Response)
async def metrics(registry: MetricsDep) -> Response:
    """Prometheus text exposition of this process."""
    return Response(content=registry.render(), media_type=registry.content_type)
