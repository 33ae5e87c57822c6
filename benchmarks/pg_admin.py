"""PostgreSQL administration for the benchmarks and the tests: databases of their own, created and dropped.

Statements such as ``CREATE DATABASE`` cannot run inside a transaction: each runs on a connection
of its own in autocommit mode, against the server's ``postgres`` maintenance database.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool


async def admin_execute(url: str, statement: str) -> None:
    """Run one statement outside any transaction, on a connection opened and closed for it."""
    engine = create_async_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            await connection.execute(text(statement))
    finally:
        await engine.dispose()


def sibling_url(database_url: str, name: str) -> str:
    """The URL of database ``name`` on the server (and with the credentials) of ``database_url``."""
    return make_url(database_url).set(database=name).render_as_string(hide_password=False)


def maintenance_url(database_url: str) -> str:
    """The ``postgres`` database on the server of ``database_url``."""
    return sibling_url(database_url, "postgres")


def database_name(database_url: str) -> str:
    name = make_url(database_url).database
    if not name:
        raise ValueError("the database URL names no database")
    return name


async def create_database(database_url: str, *, replace: bool = False) -> None:
    """Create the (empty) database that ``database_url`` names; with ``replace``, drop it first."""
    if replace:
        await drop_database(database_url)
    name = database_name(database_url)
    await admin_execute(maintenance_url(database_url), f'CREATE DATABASE "{name}"')


async def drop_database(database_url: str) -> None:
    """Drop the database that ``database_url`` names, if it exists, closing its connections."""
    name = database_name(database_url)
    await admin_execute(maintenance_url(database_url), f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
