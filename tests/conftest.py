"""Shared fixtures: a real PostgreSQL built by the Alembic migrations, the real app, rolled-back tests.

* ``settings``      — test Settings (Postgres URL from XMARK_TEST_DATABASE_URL, fixed test secrets,
                      temporary var dir, the checkpoint fetched by ``xmark fetch-model``).
* ``app``           — one app per test session, started through its real lifespan.
* ``db_connection`` — per test: one connection inside a transaction that is rolled back afterwards;
                      every session the app opens (``app.state.resources.sessionmaker``) joins it through
                      savepoints, so request handlers, background writers and caches all see the
                      test's rows and nothing outlives the test.
* ``client``        — httpx.AsyncClient over ASGITransport on that app.
* ``db_session``    — an AsyncSession on the same connection, to inspect or seed rows.
* ``make_user(role)`` -> (principal dict, API key); ``admin_key`` -> an admin's API key.

Tiers (markers registered in pyproject.toml): modules and tests mark what they need (``model``,
``vllm``, ``postgres``) where they are defined; ``pytest_collection_modifyitems`` below adds
``postgres`` to every test that uses the migrated test database, ``gpu`` to every test that skips
without CUDA. Statistical simulations that take seconds each are marked ``slow`` where they are
defined; ``make test-fast`` leaves them out.

When no selected test carries ``model`` (``make test-fast``, or a run of a few modules that need
no model), the ``app`` fixture serves ``tests.fakes.FakeBackend`` instead of loading the model;
any run that selects a ``model`` test (``make test``) starts every app with the real model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from benchmarks.pg_admin import create_database, database_name, sibling_url
from service.config import Settings
from service.db import session_scope, upgrade_database
from service.repositories.unit import Repositories

REPO_ROOT = Path(__file__).resolve().parent.parent
# Under pytest-xdist (`make test` runs two workers) each worker has a database of its own beside the
# configured one (<name>_gw0, <name>_gw1, created at its session's start): the rolled-back tests of
# one worker never see another's rows, and the processes a test starts inherit the worker's URL.
_CONFIGURED_DATABASE_URL = os.environ.get("XMARK_TEST_DATABASE_URL", "postgresql+asyncpg://root@127.0.0.1:5432/test")
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# (this module runs twice in a worker, as the root conftest and as ``tests.conftest``: the suffix is
# added once)
TEST_DATABASE_URL = (
    sibling_url(_CONFIGURED_DATABASE_URL, f"{database_name(_CONFIGURED_DATABASE_URL)}_{XDIST_WORKER}")
    if XDIST_WORKER and not database_name(_CONFIGURED_DATABASE_URL).endswith(f"_{XDIST_WORKER}")
    else _CONFIGURED_DATABASE_URL
)
os.environ["XMARK_TEST_DATABASE_URL"] = TEST_DATABASE_URL
# the database bound of the session-wide settings (see ``settings``); 5x margin and more: a fresh
# connection and a statement took 0.03 s here (0.06 s at most of 20, under a running evaluation),
# and the slowest seen under a loaded suite came 0.5 s past production's connect bound (0.5 s)
SHARED_DATABASE_TIMEOUT_S = 5.0
TEST_WATERMARK_SECRETS = {
    "v1": "test-watermark-secret-v1-5f0c2a9e71d4b386",
    "v2": "test-watermark-secret-v2-c83e1b07a6f4d952",
}
TEST_API_KEY_PEPPER = "test-api-key-pepper-8d41f2b7e9c05a63"
_KEEP_ENV = {"XMARK_TEST_DATABASE_URL", "XMARK_MODEL_PATH", "XMARK_MODEL_NAME"}

MakeUser = Callable[..., Awaitable[tuple[dict[str, Any], str]]]

# fixtures that reach the PostgreSQL test server: a test that uses one (directly or through
# app, client, db_session, ...) is marked ``postgres``
POSTGRES_FIXTURES = frozenset({"migrated_database", "e2e_database_url"})
# modules (path) and tests (path::name, every parametrisation) that are marked here rather than
# where they are defined
_FAKE_BACKEND = pytest.StashKey[bool]()


# pytest-xdist (`--dist loadgroup`) hands a worker whole groups: a module's tests together (its
# module fixtures are built once), and these packages whole, whose package- or session-wide fixtures
# (a live gateway, a browser's server, the client matrix's batch of every row) serve all their modules.
# The groups are this conftest's scheduler's (``pytest_xdist_make_scheduler``): xdist's own
# ``xdist_group`` marker does nothing under pytest 9 (it renames ``item._nodeid``, which pytest 9 no
# longer reads), so with it a module's tests were spread over both workers and each built the
# module's fixtures (the evaluation smoke run, 290 s, twice).
WHOLE_PACKAGES = ("tests/browser", "tests/clients", "tests/e2e", "tests/e2e_vllm")
# groups handed out first, the longest measured here (`pytest --durations`), so that no worker
# starts one of them while the other has nothing left; the rest follow in collection order
LONGEST_FIRST = (
    "tests/eval/test_evaluation_smoke.py",
    "tests/clients",
    "tests/e2e",
    "tests/core/test_gumbel_salts.py",
    "tests/service/services/test_message_lengths.py",
    "tests/browser",
)


def xdist_group_of(nodeid: str) -> str:
    """The group of a test: its package in WHOLE_PACKAGES, else its module."""
    module = nodeid.split("::", 1)[0]
    return next((package for package in WHOLE_PACKAGES if module.startswith(f"{package}/")), module)


def _longest_first_rank(item: pytest.Item) -> int:
    group = xdist_group_of(item.nodeid)
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadgroup":
        return None  # xdist's own schedulers for every other --dist
    from xdist.scheduler import LoadScopeScheduling

    class WholeGroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with xdist_group_of as the scope, handed out in the order the
        workers collected (LONGEST_FIRST, then collection order), not by number of tests."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    config.option.loadscopereorder = False
    return WholeGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # a stable sort: each group stays contiguous and in its order
        items.sort(key=_longest_first_rank)
    for item in items:
        if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)
        if any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)


def pytest_collection_finish(session: pytest.Session) -> None:
    # called once -m, -k and --deselect have run: ``session.items`` is what will run
    session.config.stash[_FAKE_BACKEND] = not any(item.get_closest_marker("model") for item in session.items)


@pytest.fixture(scope="session", autouse=True)
def _isolated_environment() -> Iterator[None]:
    """Developer XMARK_* variables must not leak into test settings. The suite describes the biasing
    scheme (``xmark``) unless a test says otherwise: it is set here, for test settings and the
    processes tests start. The product's default (``gumbel``, distortion-free) is tested where named:
    tests/service/test_distortion_free.py, tests/e2e_vllm/test_vllm_gumbel.py (gateway and worker on
    the defaults), tests/service/test_config.py."""
    mp = pytest.MonkeyPatch()
    for name in list(os.environ):
        if name.startswith("XMARK_") and name not in _KEEP_ENV:
            mp.delenv(name)
    mp.setenv("XMARK_WATERMARK_SCHEME", "xmark")
    yield
    mp.undo()


def checkpoint_path() -> Path:
    """The checkpoint `xmark fetch-model` builds for the default settings in this checkout."""
    explicit = os.environ.get("XMARK_MODEL_PATH")
    if explicit:
        return Path(explicit)
    name = os.environ.get("XMARK_MODEL_NAME", "smollm2-135m-instruct")
    return REPO_ROOT / "var" / "models" / name


def make_test_settings(var_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": TEST_DATABASE_URL,
        "var_dir": var_dir,
        "watermark_secrets": SecretStr(",".join(f"{k}:{v}" for k, v in TEST_WATERMARK_SECRETS.items())),
        "api_key_pepper": SecretStr(TEST_API_KEY_PEPPER),
        "model_path": checkpoint_path(),
        "keyring_refresh_seconds": 0,
        "database_pool_size": 5,
        "trace_warm_row_tokens": 0,  # tests that need it switch it on
        # the IDs drawn ahead are read in the background, in a unit of work of their own: the shared
        # app's sessions all join one test's transaction, so its first sights draw their own
        # (tests/service/end_users/test_first_sight.py tests the pool on databases of its own)
        "end_users_ids_ahead": 0,
        # slots are reserved and claimed in units of work of their own too (tests/service/end_users/test_reserve.py)
        "end_users_reserve": 0,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    # The shared app and engines talk to the shared server while the rest of the suite loads the
    # 2 cores (models, private servers, subprocesses): the request bound of production (1 s, half of
    # it to connect) refused a connection that came 0.5 s late there. Tests of that bound build
    # settings of their own (make_test_settings) and keep the default.
    # The shared app's in-process clients all come from loopback, and the suite sends it many unknown
    # keys on purpose: it opts loopback out of the failed-authentication budget (the product's default
    # exempts nothing), or a module's refusals would back its later tests off. The budget's own tests
    # (tests/service/services/test_auth_edge.py) run gateways of their own on the default.
    return make_test_settings(
        tmp_path_factory.mktemp("var"),
        database_timeout_s=SHARED_DATABASE_TIMEOUT_S,
        auth_edge_exempt="127.0.0.0/8,::1/128",
    )


async def reset_database(url: str) -> None:
    """Drop every object of the test database (PostgreSQL: the public schema)."""
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
            await conn.execute(text("CREATE SCHEMA public"))
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
async def migrated_database(settings: Settings) -> str:
    """The test database, emptied and rebuilt by the Alembic migrations once per session (a worker's
    own database is created afresh)."""
    if XDIST_WORKER and settings.database_url == TEST_DATABASE_URL:
        await create_database(settings.database_url, replace=True)
    await reset_database(settings.database_url)
    await asyncio.to_thread(upgrade_database, settings.database_url)
    return settings.database_url


@pytest.fixture(scope="session")
async def app(request: pytest.FixtureRequest, settings: Settings, migrated_database: str) -> AsyncIterator[Any]:
    """The app, started through its lifespan; with the fake backend when no selected test needs the model."""
    import service.resources
    from service.app import create_app

    fake = request.config.stash.get(_FAKE_BACKEND, False)
    built: list[Any] = []

    def build_fake_backend(settings: Settings, metrics: Any) -> Any:
        from tests.fakes import FakeBackend

        built.append(FakeBackend(settings.model_name))
        return built[-1]

    with pytest.MonkeyPatch.context() as mp:
        if fake:
            mp.setattr(service.resources, "build_backend", build_fake_backend)
        application = create_app(settings)
        async with application.router.lifespan_context(application):
            # never a model where the fake was meant: the lifespan must have built its backend here
            assert built or not fake, "the lifespan no longer calls service.resources.build_backend"
            await start_up_work_done(application)
            yield application


async def start_up_work_done(application: Any) -> None:
    """Wait for the app's start-up work on the database. The start-up load of the registry and the
    end users' backfill open sessions from the app's sessionmaker, which ``db_connection`` binds to
    a test's connection: work still running then would share that connection with the test's own
    queries (and break its savepoint)."""
    resources = application.state.resources
    for start_up_work in (resources.registry_warmer, resources.end_user_backfill):
        # 5x margin and more: both take well under a second on the test databases
        await asyncio.wait_for(asyncio.shield(start_up_work), 120)


@pytest.fixture
async def db_connection(app: Any) -> AsyncIterator[AsyncConnection]:
    engine = app.state.resources.engine
    sessionmaker = app.state.resources.sessionmaker
    async with engine.connect() as connection:
        transaction = await connection.begin()
        sessionmaker.configure(bind=connection, join_transaction_mode="create_savepoint")
        try:
            yield connection
        finally:
            # the key uses the test's requests noted are written into its transaction (and rolled
            # back with it), so the app's background writer has nothing left to write between tests;
            # a test that broke its transaction keeps its own failure (and the rollback still runs)
            with contextlib.suppress(Exception):
                await app.state.resources.authenticator.last_use.flush()
            sessionmaker.configure(bind=engine, join_transaction_mode="conditional_savepoint")
            await transaction.rollback()
    # in-memory state derived from rows the test created must not outlive the rollback
    async with session_scope(sessionmaker) as session:
        await app.state.resources.keyring.refresh(session)


@pytest.fixture
async def db_session(db_connection: AsyncConnection) -> AsyncIterator[AsyncSession]:
    async with AsyncSession(
        bind=db_connection, join_transaction_mode="create_savepoint", expire_on_commit=False
    ) as session:
        yield session


@pytest.fixture
async def client(app: Any, db_connection: AsyncConnection) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


@pytest.fixture
def make_user(app: Any, db_connection: AsyncConnection) -> MakeUser:
    """Create a user inside the test transaction; returns (principal dict, plaintext API key)."""
    from service.services.users import UserService

    counter = itertools.count(1)

    async def factory(role: str = "user", name: str | None = None) -> tuple[dict[str, Any], str]:
        async with session_scope(app.state.resources.sessionmaker) as session:
            created = await UserService(
                Repositories(session), app.state.resources.keyring.params, app.state.resources.api_key_hasher
            ).create_user(name or f"{role}-{next(counter)}", role)  # type: ignore[arg-type]
        principal = {
            "id": created.id,
            "user_id": created.id,
            "name": created.name,
            "role": created.role,
            "message_id": created.message_id,
            "message_ids": [m.model_dump() for m in created.message_ids],
        }
        return principal, created.api_key

    return factory


@pytest.fixture
async def admin_key(make_user: MakeUser) -> str:
    _, key = await make_user("admin", "test-admin")
    return key
