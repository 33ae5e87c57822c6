"""generations.choice_index with a unique key per (request_id, choice_index), so that a record
written twice (a retried write whose first attempt did commit, a spooled record drained again) is
kept once; per-user admission limits on users (NULL: the gateway's default, 0: unlimited).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIMIT_COLUMNS = ("max_parallel_requests", "requests_per_minute", "tokens_per_minute")


def upgrade() -> None:
    with op.batch_alter_table("generations") as batch:
        batch.add_column(sa.Column("choice_index", sa.Integer(), nullable=False, server_default="0"))
    # rows written before this revision carry no index: number the rows of each request in the
    # order they were inserted (portable SQL: SQLite and PostgreSQL)
    op.execute(
        "UPDATE generations SET choice_index = ("
        "SELECT count(*) FROM generations AS earlier "
        "WHERE earlier.request_id = generations.request_id AND earlier.id < generations.id)"
    )
    with op.batch_alter_table("generations") as batch:
        batch.create_unique_constraint("uq_generations_request_id_choice_index", ["request_id", "choice_index"])
    with op.batch_alter_table("users") as batch:
        for name in LIMIT_COLUMNS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("users") as batch:
        for name in reversed(LIMIT_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("generations") as batch:
        batch.drop_constraint("uq_generations_request_id_choice_index", type_="unique")
        batch.drop_column("choice_index")
