"""End-user limits: per-account overrides on ``users`` of the caps on the account's end users
(``end_users_max``, ``end_users_new_per_minute``) and of each end user's requests and tokens per
minute (``end_user_requests_per_minute``, ``end_user_tokens_per_minute``); one end user's own
``requests_per_minute`` and ``tokens_per_minute`` on ``end_users``. Every column is nullable: NULL
takes the next level's value (end user -> account -> the gateway's setting), 0 is unlimited.
``ix_generations_end_user_id_created_at`` (partial: rows of an end user only) serves an end user's
usage over a window.

Downgrading drops the columns and the index; the generation records are untouched.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-18 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

USER_COLUMNS = (
    "end_users_max",
    "end_users_new_per_minute",
    "end_user_requests_per_minute",
    "end_user_tokens_per_minute",
)
END_USER_COLUMNS = ("requests_per_minute", "tokens_per_minute")
USAGE_INDEX = "ix_generations_end_user_id_created_at"
HAS_END_USER = "end_user_id IS NOT NULL"


def upgrade() -> None:
    # users and end_users have no triggers: SQLite's copy of a table loses nothing
    with op.batch_alter_table("users") as batch:
        for name in USER_COLUMNS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=True))
    with op.batch_alter_table("end_users") as batch:
        for name in END_USER_COLUMNS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=True))
    # an index only (no copy of generations, whose triggers stay as they are)
    op.create_index(
        USAGE_INDEX,
        "generations",
        ["end_user_id", "created_at"],
        unique=False,
        postgresql_where=sa.text(HAS_END_USER),
        sqlite_where=sa.text(HAS_END_USER),
    )


def downgrade() -> None:
    op.drop_index(USAGE_INDEX, table_name="generations")
    with op.batch_alter_table("end_users") as batch:
        for name in reversed(END_USER_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("users") as batch:
        for name in reversed(USER_COLUMNS):
            batch.drop_column(name)
