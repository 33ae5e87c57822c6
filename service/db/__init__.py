"""The database layer: engine and units of work, the record writer, migrations."""

from service.db.engine import (
    MAINTENANCE_TIMEOUT_S,
    create_engine,
    create_sessionmaker,
    ensure_sqlite_dir,
    execute_committed,
    install_fault_handling,
    install_liveness_check,
    is_database_fault,
    ping,
    read_rows,
    session_scope,
)
from service.db.migrations import alembic_config, downgrade_database, upgrade_database
from service.db.row_writer import RowWriter

__all__ = [
    "MAINTENANCE_TIMEOUT_S",
    "RowWriter",
    "alembic_config",
    "create_engine",
    "create_sessionmaker",
    "downgrade_database",
    "ensure_sqlite_dir",
    "execute_committed",
    "install_fault_handling",
    "install_liveness_check",
    "is_database_fault",
    "ping",
    "read_rows",
    "session_scope",
    "upgrade_database",
]
