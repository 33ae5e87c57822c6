"""Everything a running gateway process holds, in one typed object built by the app's lifespan.

``open_resources`` creates each resource in order and registers its disposal on an
``AsyncExitStack``, so whatever was opened is closed again, in reverse order, however the start-up
or the process ends. Routers reach the object through one dependency (``service.deps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

from sqlalchemy import make_url
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from service.backends import Backend, build_backend
from service.config import ConfigurationError, Settings, load_secrets
from service.db import MAINTENANCE_TIMEOUT_S, RowWriter, create_engine, create_sessionmaker, session_scope
from service.db.spool import SpooledWriter, open_generation_records
from service.embeddings.models import EmbeddingModel, EmbeddingModels, build_embedding_backend
from service.embeddings.records import EmbeddingRecords, open_embedding_records
from service.end_users.directory import EndUserCache, EndUserDirectory
from service.errors import ServiceUnavailableError
from service.fleet import Fleet, ServedModel, embedding_model_settings, model_settings
from service.keyring import Keyring, prepare_null_distributions, spec_from_settings
from service.metrics import Metrics
from service.models import Generation, Trace
from service.provenance.sketch import Sketcher, derive_sketch_key
from service.repositories.planner import PlannerStatistics
from service.salts import SaltRotation
from service.security import ApiKeyHasher, parse_api_key
from service.services.admission import Admission, open_admission
from service.services.audit import SYSTEM_ACTOR, UNRECORDED, AuditTrail, AuditWriter, key_version_registered
from service.services.auth import Authenticator
from service.services.auth_cache import AuthCache
from service.services.auth_edge import AuthEdge
from service.services.bootstrap import ensure_first_admin
from service.services.last_use import LastUseRecorder
from service.services.message_ids import backfill_message_ids
from service.services.registry_cache import RegistryCache
from service.services.reports import ReportSigner
from service.telemetry import Telemetry, open_telemetry
from service.vocabulary import KeyVersionStatus
from xmark_core import WatermarkParams
from xmark_core.encoders import KeyVersionSpec

logger = logging.getLogger("xmark.app")


@dataclass(eq=False)
class Resources:
    """The process's resources. Fields are replaced only by tests (e.g. a backend that is loading)."""

    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    # generation records: the database, or a local spool drained into it
    generation_records: SpooledWriter
    trace_records: RowWriter
    metrics: Metrics
    keyring: Keyring
    api_key_hasher: ApiKeyHasher
    authenticator: Authenticator
    # the served models, each with its backend (the first is the default)
    fleet: Fleet
    registry_cache: RegistryCache
    # every configured secret as text, redacted from error messages
    secret_values: tuple[str, ...]
    # embedded mode with generated secrets: a key version may be activated without a configured secret
    secrets_can_generate: bool
    # the start-up simulation of /trace's null distributions (None when switched off)
    trace_null_warmer: asyncio.Task[None] | None
    # the start-up load of /trace's registry snapshots (its own sessions from ``sessionmaker``)
    registry_warmer: asyncio.Task[None]
    # chat requests' admission: the backend's queue bound and the per-user limits
    admission: Admission
    # signs trace reports (its public key is served at /.well-known/xmark-report-key)
    report_signer: ReportSigner
    # the embedding models (POST /v1/embeddings; none unless configured) and their usage records
    embeddings: EmbeddingModels
    embedding_records: EmbeddingRecords
    # the accounts' end users a request names: first sight, caps, the per-process cache
    end_users: EndUserDirectory
    # the start-up backfill of end users' IDs of every length in use (``EndUserDirectory.backfill``)
    end_user_backfill: asyncio.Task[None]
    # OpenTelemetry spans (a no-op tracer unless an OTLP endpoint is configured)
    telemetry: Telemetry = field(default_factory=Telemetry)
    # content sketches of completions and suspect texts (None: XMARK_PROVENANCE=off)
    sketcher: Sketcher | None = None
    # PostgreSQL: the planner's statistics of the sketches' terms, cached for the process
    planner_statistics: PlannerStatistics = field(default_factory=PlannerStatistics)
    # each user's next salt under a salted distortion-free key version (service.salts)
    salt_rotation: SaltRotation = field(default_factory=SaltRotation)

    @property
    def backend(self) -> Backend:
        """The default model's backend."""
        return self.fleet.default.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self.fleet.replace_backend(self.fleet.default.name, backend)


def startup_audit(signer: ReportSigner) -> AuditTrail:
    """The audit trail of the start-up writes: the gateway itself (actor ``system``)."""
    return AuditTrail(signer, SYSTEM_ACTOR)


async def sync_keyring(
    keyring: Keyring, sessionmaker: async_sessionmaker[AsyncSession], audit: AuditWriter = UNRECORDED
) -> None:
    """Register the configured key versions, load the usable ones, and give every user a message
    ID of each key version's message length (nothing to do unless a version of a new length was
    registered). Each registration and each batch of IDs is recorded by ``audit`` in its unit of work."""
    try:
        async with session_scope(sessionmaker) as session:
            for row in await keyring.sync(session):
                await audit.record(session, key_version_registered(row))
        await backfill_message_ids(sessionmaker, audit=audit)
    except (OperationalError, ProgrammingError) as exc:
        cause = exc.orig if isinstance(exc, DBAPIError) else exc
        if isinstance(cause, (TimeoutError, OSError)):  # a statement past its bound, a lost connection
            raise ConfigurationError(
                f"the database did not answer during start-up ({type(cause).__name__}): "
                "is it reachable and not overloaded?"
            ) from None
        raise ConfigurationError(
            f"the database schema is missing or outdated: run `xmark migrate` ({type(cause).__name__})"
        ) from None


@asynccontextmanager
async def startup_sessions(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession]
) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions for the start-up writes (key versions, the message-ID backfill, the first admin).

    They are maintenance, not a request: on PostgreSQL a statement of a backfill over a large
    registry may outlast ``XMARK_DATABASE_TIMEOUT_S`` (the bound of every request's statements), so
    they get an engine of their own under :data:`MAINTENANCE_TIMEOUT_S`, closed again once they are
    done. SQLite bounds only the wait for its lock, never a statement: the process's sessions serve.
    """
    if make_url(settings.database_url).get_backend_name() == "sqlite":
        yield sessionmaker
        return
    engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)
    try:
        yield create_sessionmaker(engine)
    finally:
        await engine.dispose()


async def bootstrap_admin(
    settings: Settings,
    sessionmaker: async_sessionmaker[AsyncSession],
    params: WatermarkParams | KeyVersionSpec,
    hasher: ApiKeyHasher,
    audit: AuditWriter,
) -> None:
    """With ``XMARK_BOOTSTRAP_ADMIN_KEY``: that key becomes the first admin's if there is none."""
    if settings.bootstrap_admin_key is not None:
        async with session_scope(sessionmaker) as session:
            await ensure_first_admin(
                session,
                params,
                hasher,
                audit=audit,
                api_key=parse_api_key(settings.bootstrap_admin_key.get_secret_value()),
            )


def _encoding_length(keyring: Keyring) -> tuple[int, int] | None:
    try:
        params = keyring.active().key.params
    except ServiceUnavailableError:
        return None
    return (params.bits, params.block_bits)


async def _refresh_keyring(
    keyring: Keyring, sessionmaker: async_sessionmaker[AsyncSession], interval: float, auth_cache: AuthCache
) -> None:
    """Pick up key-version changes made through other replicas."""
    while True:
        await asyncio.sleep(interval)
        try:
            before = _encoding_length(keyring)
            async with session_scope(sessionmaker) as session:
                await keyring.refresh(session)
            if _encoding_length(keyring) != before:
                # a version of another message length encodes now: principals cached before its
                # users' IDs were allocated would lack them
                auth_cache.clear()
        except Exception as exc:  # keep serving with the last known keyring
            logger.warning("keyring refresh failed", extra={"error_type": type(exc).__name__})


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def sketcher_for(settings: Settings, secret: bytes) -> Sketcher | None:
    """The sketcher of completions and suspect texts, keyed from a server secret (the API-key
    pepper, under a label of its own); None when provenance is off."""
    return Sketcher(derive_sketch_key(secret)) if settings.provenance == "on" else None


# Set by ``xmark serve`` for its processes (one gateway each, for the process's life). An app built
# inside another program (the tests, a benchmark's in-process gateway) leaves the collector alone:
# freezing there would keep every later-discarded app's cycles for good.
FREEZE_START_UP_HEAP = False


def freeze_start_up_heap_in_this_process() -> None:
    global FREEZE_START_UP_HEAP
    FREEZE_START_UP_HEAP = True


async def _freeze_start_up_heap(fleet: Fleet, embeddings: EmbeddingModels, *warmers: asyncio.Task[None] | None) -> None:
    """Once the start-up work is done (every model ready, the trace null distributions prepared, the
    trace registry loaded),
    move what it allocated out of the garbage collector's reach (``gc.freeze``).

    Those objects (tokenizers, the null distributions, the imported libraries) live as long as the
    process, yet every full collection walked them all: under load a collection stopped the event
    loop for about 300 ms every few seconds, and the slowest 1 % of requests at concurrency 16
    took 332 ms; frozen, 81 ms (`make bench-gateways`, fake upstream, 2 cores)."""
    for served in fleet:
        await served.backend.wait_ready(None)
    for embedding in embeddings:
        await embedding.backend.wait_ready(None)
    for warmer in warmers:
        if warmer is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(warmer)
    gc.collect()
    gc.freeze()
    logger.info("start-up heap frozen", extra={"objects": gc.get_freeze_count()})


def _background(stack: AsyncExitStack, task: asyncio.Task[None]) -> asyncio.Task[None]:
    stack.push_async_callback(_cancel, task)
    return task


def _check_scheme_served(keyring: Keyring, model: str, backend: Backend) -> None:
    """Refuse to start a model whose backend cannot encode with the active key version's scheme
    (``gumbel`` samples: the vLLM workers' processors only bias). A version activated later is
    checked per request (``scheme_not_served``)."""
    active = next((h for h in keyring.usable() if h.status == KeyVersionStatus.ACTIVE), None)
    scheme = active.key.params.scheme if active is not None else keyring.params.scheme
    if scheme not in backend.schemes:
        of = f"key version {active.name!r}" if active is not None else "new key versions (XMARK_WATERMARK_SCHEME)"
        raise ConfigurationError(
            f"model {model!r}: its backend does not serve the watermark scheme {scheme!r} of {of}; "
            f"it serves {', '.join(sorted(backend.schemes))}"
        )


@asynccontextmanager
async def open_resources(settings: Settings) -> AsyncIterator[Resources]:
    """Open every resource of a gateway process; all are closed when the context exits."""
    secrets = load_secrets(settings)
    bootstrap_key = settings.bootstrap_admin_key
    secret_values = tuple(
        value
        for value in (
            *(v.decode(errors="ignore") for v in secrets.all_values()),
            bootstrap_key.get_secret_value() if bootstrap_key is not None else "",
        )
        if value
    )
    async with AsyncExitStack() as stack:
        telemetry = open_telemetry(settings)
        stack.callback(telemetry.shutdown)  # last out: flushes the spans of the shutdown too
        engine = create_engine(settings)
        stack.push_async_callback(engine.dispose)
        sessionmaker = create_sessionmaker(engine)
        trace_records = RowWriter(sessionmaker, Trace.__table__)  # type: ignore[arg-type]  # a Table
        stack.push_async_callback(trace_records.close)
        metrics = Metrics()
        # closed after the backend: records of the generations it ends are flushed (or spooled)
        generation_records = await stack.enter_async_context(
            open_generation_records(settings, sessionmaker, Generation.__table__, metrics)  # type: ignore[arg-type]
        )
        params = spec_from_settings(settings)
        keyring = Keyring(params, secrets.watermark)
        hasher = ApiKeyHasher(secrets.api_key_pepper)
        report_signer = ReportSigner.from_secret(secrets.report_signing)
        # `xmark serve` has done these writes before starting its workers (service.app.prepare_database);
        # an app served another way (an ASGI server of its own, a benchmark) does them here
        async with startup_sessions(settings, sessionmaker) as startup:
            await sync_keyring(keyring, startup, startup_audit(report_signer))
            await bootstrap_admin(settings, startup, params, hasher, startup_audit(report_signer))
        # the keys' last uses: written in batches after the responses, and once more at shutdown
        last_use = LastUseRecorder(sessionmaker, timeout_s=settings.database_timeout_s)
        last_use.start()
        stack.push_async_callback(last_use.close)
        authenticator = Authenticator(
            sessionmaker,
            hasher,
            AuthCache(
                settings.auth_cache_ttl_s, settings.auth_cache_size, refusal_ttl=settings.auth_negative_cache_ttl_s
            ),
            last_use=last_use,
        )
        served = []
        for own, aliases in model_settings(settings):
            backend = build_backend(own, metrics)
            _check_scheme_served(keyring, own.model_name, backend)
            stack.push_async_callback(backend.close)
            await backend.start()
            # without a models file the one model follows the process settings themselves
            served.append(ServedModel(own.model_name, backend, None if own is settings else own, aliases))
        embedding_records = await stack.enter_async_context(open_embedding_records(settings, sessionmaker, metrics))
        embedding_served = []
        for own, aliases in embedding_model_settings(settings):
            embedding_backend = build_embedding_backend(own)
            stack.push_async_callback(embedding_backend.close)
            await embedding_backend.start()
            embedding_served.append(EmbeddingModel(own.model_name, embedding_backend, own, aliases))
        embeddings = EmbeddingModels(embedding_served)
        try:
            fleet = Fleet(served, embedding=embeddings.names())
        except ValueError as exc:  # a name of both kinds
            raise ConfigurationError(f"the served models: {exc}") from None
        admission = await stack.enter_async_context(open_admission(settings, metrics))
        # the per-address budget of failed authentications, shared through the admission's Redis
        authenticator.edge = AuthEdge.from_settings(settings, metrics, admission.redis)
        if settings.keyring_refresh_seconds > 0:
            _background(
                stack,
                asyncio.create_task(
                    _refresh_keyring(keyring, sessionmaker, settings.keyring_refresh_seconds, authenticator.cache)
                ),
            )
        warmer = None
        if settings.trace_warm_row_tokens > 0:
            warmer = _background(
                stack, asyncio.create_task(prepare_null_distributions(keyring, settings.trace_warm_row_tokens))
            )
        registry_cache = RegistryCache(sessionmaker)
        # the registry's snapshots of the usable versions' lengths, loaded before the first trace needs them
        registry_warmer = _background(
            stack, asyncio.create_task(registry_cache.warm([handle.key.params for handle in keyring.readings()]))
        )
        end_users = EndUserDirectory(
            sessionmaker=sessionmaker,
            settings=settings,
            configured=keyring.spec,
            signer=report_signer,
            cache=EndUserCache(settings.auth_cache_ttl_s, settings.auth_cache_size),
            on_change=registry_cache.invalidate,
        )
        stack.push_async_callback(end_users.aclose)
        # existing end users' IDs of a length that became usable since they were first seen
        end_user_backfill = end_users.backfill()
        if FREEZE_START_UP_HEAP:
            _background(stack, asyncio.create_task(_freeze_start_up_heap(fleet, embeddings, warmer, registry_warmer)))
        yield Resources(
            settings=settings,
            engine=engine,
            sessionmaker=sessionmaker,
            generation_records=generation_records,
            trace_records=trace_records,
            metrics=metrics,
            keyring=keyring,
            api_key_hasher=hasher,
            authenticator=authenticator,
            fleet=fleet,
            registry_cache=registry_cache,
            secret_values=secret_values,
            secrets_can_generate=settings.embedded and secrets.watermark_source == "generated",
            trace_null_warmer=warmer,
            registry_warmer=registry_warmer,
            admission=admission,
            report_signer=report_signer,
            embeddings=embeddings,
            embedding_records=embedding_records,
            end_users=end_users,
            end_user_backfill=end_user_backfill,
            telemetry=telemetry,
            sketcher=sketcher_for(settings, secrets.api_key_pepper),
        )
