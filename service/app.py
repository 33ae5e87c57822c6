"""The FastAPI application and its lifespan (every resource is created and disposed there)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from service.config import Settings, load_secrets
from service.db import MAINTENANCE_TIMEOUT_S, create_engine, create_sessionmaker
from service.embeddings.router import router as embeddings_router
from service.end_users.router import router as end_users_router
from service.errors import ANTHROPIC_PATHS, install_error_handlers
from service.keyring import Keyring, spec_from_settings
from service.logging import configure_logging
from service.middleware import RequestBodyMiddleware, RequestContextMiddleware
from service.resources import (
    bootstrap_admin,
    freeze_start_up_heap_in_this_process,
    open_resources,
    startup_audit,
    sync_keyring,
)
from service.routers import admin, audit, chat, completions, console, health, me, messages, responses
from service.routers.api_docs import install_api_docs
from service.security import ApiKeyHasher
from service.services.reports import ReportSigner
from service.telemetry import TracingMiddleware
from service.trace import router as trace

logger = logging.getLogger("xmark.app")


async def prepare_database(settings: Settings) -> None:
    """The start-up writes every gateway process would otherwise race for, done once: the rows of
    the configured key versions and, with ``XMARK_BOOTSTRAP_ADMIN_KEY``, the first admin.
    ``xmark serve --workers N`` runs this before it starts the workers, which then find them. Each
    write is recorded in the registry's audit trail with the actor ``system``."""
    secrets = load_secrets(settings)
    engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)  # a backfill may take long
    try:
        sessionmaker = create_sessionmaker(engine)
        params = spec_from_settings(settings)
        audit = startup_audit(ReportSigner.from_secret(secrets.report_signing))
        await sync_keyring(Keyring(params, secrets.watermark), sessionmaker, audit)
        await bootstrap_admin(settings, sessionmaker, params, ApiKeyHasher(secrets.api_key_pepper), audit)
    finally:
        await engine.dispose()


def configure_process_logging(settings: Settings) -> None:
    """JSON logs on stderr for a serving process, with every configured secret redacted."""
    secrets = load_secrets(settings)
    bootstrap = [settings.bootstrap_admin_key.get_secret_value()] if settings.bootstrap_admin_key else []
    configure_logging(settings.log_level, [*secrets.all_values(), *bootstrap])


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    async with open_resources(settings) as resources:
        app.state.resources = resources
        logger.info(
            "gateway started",
            extra={"backend": settings.backend, "key_version": resources.keyring.active().name},
        )
        try:
            yield
        finally:
            del app.state.resources


def create_worker_app() -> FastAPI:
    """The application of one ``xmark serve --workers N`` process (an ASGI factory for uvicorn):
    settings from the environment, as in the process that started it."""
    settings = Settings()
    configure_process_logging(settings)
    freeze_start_up_heap_in_this_process()
    return create_app(settings)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the gateway application (resources are opened by its lifespan)."""
    settings = settings or Settings()
    app = FastAPI(
        title="xmark-gateway",
        summary="OpenAI-compatible gateway that watermarks every completion with its requester.",
        version="0.1.0",
        lifespan=lifespan,
        # no 307 from "/v1/models/" to "/v1/models": its Location would be built from the Host header
        redirect_slashes=False,
        # FastAPI's own /docs and /redoc load their assets from a CDN: install_api_docs serves them
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.api_docs else None,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(
        RequestBodyMiddleware,
        max_body_bytes=settings.max_body_bytes,
        body_read_timeout_s=settings.body_read_timeout_s,
    )
    app.add_middleware(RequestContextMiddleware)
    # outermost: the server span covers the whole request (a no-op unless telemetry is configured)
    app.add_middleware(TracingMiddleware)
    # routes are matched in this order: the busiest first
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(completions.router)
    app.include_router(embeddings_router)
    app.include_router(trace.router)
    app.include_router(trace.public_router)
    app.include_router(me.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(end_users_router)
    app.include_router(audit.router)
    app.include_router(console.router)
    if settings.api_docs:
        install_api_docs(app)
        _no_422_on_anthropic_routes(app)
    return app


def _no_422_on_anthropic_routes(app: FastAPI) -> None:
    """Drop FastAPI's automatic 422 from the schema of Anthropic's routes: a body that does not
    match is a 400 ``invalid_request_error`` there (``service.errors.ANTHROPIC_STATUSES``)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path in ANTHROPIC_PATHS:
                for operation in schema.get("paths", {}).get(path, {}).values():
                    operation.get("responses", {}).pop("422", None)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
