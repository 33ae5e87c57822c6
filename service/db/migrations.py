"""Alembic entry points: the only way the schema changes."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def alembic_config(database_url: str) -> Config:
    """Alembic configuration for ``database_url`` (does not touch the logging setup)."""
    config = Config(str(PROJECT_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    config.attributes["database_url"] = database_url
    config.attributes["skip_logging_config"] = True
    return config


def upgrade_database(database_url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (blocking; runs its own event loop)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade_database(database_url: str, revision: str) -> None:
    """Revert migrations down to ``revision`` ("base" removes every table)."""
    command.downgrade(alembic_config(database_url), revision)
