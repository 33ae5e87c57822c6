"""The FastAPI application and its lifespan (every resource is created and disposed here)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.backends import build_backend
from service.config import ConfigurationError, Settings, load_secrets
from service.db import RowWriter, create_engine, create_sessionmaker, session_scope
from service.errors import install_error_handlers
from service.keyring import Keyring, params_from_settings
from service.logging import configure_logging
from service.metrics import Metrics
from service.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from service.models import Generation, Trace
from service.routers import admin, chat, health, trace
from service.security import ApiKeyHasher, parse_api_key
from service.services.auth import Authenticator
from service.services.auth_cache import AuthCache
from service.services.bootstrap import ensure_first_admin
from service.services.registry_cache import RegistryCache
from service.services.tracing import prepare_null_distributions
from xmark_core import WatermarkParams

logger = logging.getLogger("xmark.app")


async def _refresh_keyring(app: FastAPI, interval: float) -> None:
    """Pick up key-version changes made through other replicas."""
    while True:
        await asyncio.sleep(interval)
        try:
            async with session_scope(app.state.sessionmaker) as session:
                await app.state.keyring.refresh(session)
        except Exception as exc:  # keep serving with the last known keyring
            logger.warning("keyring refresh failed", extra={"error_type": type(exc).__name__})


async def _sync_keyring(keyring: Keyring, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
    try:
        async with session_scope(sessionmaker) as session:
            await keyring.sync(session)
    except (OperationalError, ProgrammingError) as exc:
        raise ConfigurationError(
            "the database schema is missing or outdated: run `xmark migrate` "
            f"({type(exc.orig).__name__ if isinstance(exc, DBAPIError) else type(exc).__name__})"
        ) from None


async def _bootstrap_admin(
    settings: Settings,
    sessionmaker: async_sessionmaker[AsyncSession],
    params: WatermarkParams,
    hasher: ApiKeyHasher,
) -> None:
    if settings.bootstrap_admin_key is not None:
        async with session_scope(sessionmaker) as session:
            await ensure_first_admin(
                session, params, hasher, api_key=parse_api_key(settings.bootstrap_admin_key.get_secret_value())
            )


async def prepare_database(settings: Settings) -> None:
    """The start-up writes every gateway process would otherwise race for, done once: the rows of
    the configured key versions and, with ``XMARK_BOOTSTRAP_ADMIN_KEY``, the first admin.
    ``xmark serve --workers N`` runs this before it starts the workers, which then find them."""
    secrets = load_secrets(settings)
    engine = create_engine(settings)
    try:
        sessionmaker = create_sessionmaker(engine)
        params = params_from_settings(settings)
        await _sync_keyring(Keyring(params, secrets.watermark), sessionmaker)
        await _bootstrap_admin(settings, sessionmaker, params, ApiKeyHasher(secrets.api_key_pepper))
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
    secrets = load_secrets(settings)
    bootstrap_key = settings.bootstrap_admin_key
    app.state.secret_values = tuple(
        value
        for value in (
            *(v.decode(errors="ignore") for v in secrets.all_values()),
            bootstrap_key.get_secret_value() if bootstrap_key is not None else "",
        )
        if value
    )
    engine = create_engine(settings)
    app.state.engine = engine
    app.state.sessionmaker = create_sessionmaker(engine)
    app.state.generation_records = RowWriter(app.state.sessionmaker, Generation.__table__)
    app.state.trace_records = RowWriter(app.state.sessionmaker, Trace.__table__)
    refresher: asyncio.Task[None] | None = None
    warmer: asyncio.Task[None] | None = None
    backend = None
    try:
        app.state.metrics = Metrics()
        params = params_from_settings(settings)
        keyring = Keyring(params, secrets.watermark)
        await _sync_keyring(keyring, app.state.sessionmaker)
        app.state.keyring = keyring
        app.state.api_key_hasher = ApiKeyHasher(secrets.api_key_pepper)
        app.state.authenticator = Authenticator(
            app.state.sessionmaker,
            app.state.api_key_hasher,
            AuthCache(settings.auth_cache_ttl_s, settings.auth_cache_size),
        )
        app.state.secrets_can_generate = settings.embedded and secrets.watermark_source == "generated"
        await _bootstrap_admin(settings, app.state.sessionmaker, params, app.state.api_key_hasher)
        backend = build_backend(settings, app.state.metrics)
        app.state.backend = backend
        await backend.start()
        app.state.registry_cache = RegistryCache(app.state.sessionmaker, params)
        if settings.keyring_refresh_seconds > 0:
            refresher = asyncio.create_task(_refresh_keyring(app, settings.keyring_refresh_seconds))
        if settings.trace_warm_row_tokens > 0:
            warmer = asyncio.create_task(prepare_null_distributions(keyring, settings.trace_warm_row_tokens))
        app.state.trace_null_warmer = warmer
        logger.info(
            "gateway started",
            extra={"backend": settings.backend, "key_version": keyring.active().name},
        )
        yield
    finally:
        for task in (refresher, warmer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if backend is not None:
            await backend.close()
        await app.state.generation_records.close()
        await app.state.trace_records.close()
        await engine.dispose()


def create_worker_app() -> FastAPI:
    """The application of one ``xmark serve --workers N`` process (an ASGI factory for uvicorn):
    settings from the environment, as in the process that started it."""
    settings = Settings()
    configure_process_logging(settings)
    return create_app(settings)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the gateway application (resources are opened by its lifespan)."""
    settings = settings or Settings()
    app = FastAPI(
        title="xmark-gateway",
        summary="OpenAI-compatible gateway that watermarks every completion with its requester.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware)
    # routes are matched in this order: the busiest first
    app.include_router(chat.router)
    app.include_router(trace.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    return app
