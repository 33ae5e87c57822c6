"""Embedding requests: one ``embedding_records`` row per ``POST /v1/embeddings`` request, and their
usage in ``usage_daily``.

An embedding is not generated text: it has no ``generations`` row (no watermark, no completion
hash, no sketch). ``embedding_records`` keeps who asked, which model, how many texts and input
tokens (never the texts), keyed by the request id so a retried write adds nothing. Triggers add
each inserted row to its user's ``usage_daily`` row of that UTC day, in two new columns,
``embedding_requests`` and ``embedding_tokens`` (0 on every existing row and on rows the
generation triggers create), as revision 0007's do for generation records: a statement-level
trigger with a transition table on PostgreSQL (its rows in (user, day) order), a row-level trigger
on SQLite. ``usage_day_totals`` counts a (user, day) row an embedding request creates like any other.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_USAGE_COLUMNS = ("embedding_requests", "embedding_tokens")
_COLUMNS = (
    "(user_id, day, requests, completions, prompt_tokens, completion_tokens, embedding_requests, embedding_tokens)"
)
_ADD = """
    ON CONFLICT (user_id, day) DO UPDATE SET
        embedding_requests = usage_daily.embedding_requests + excluded.embedding_requests,
        embedding_tokens = usage_daily.embedding_tokens + excluded.embedding_tokens
"""
_PG_DAY = "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

PG_FUNCTION = f"""
CREATE FUNCTION usage_daily_add_embeddings() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_daily {_COLUMNS}
    SELECT user_id, {_PG_DAY} AS day, 0, 0, 0, 0, count(*), coalesce(sum(prompt_tokens), 0)
    FROM added GROUP BY 1, 2 ORDER BY 2, 1
    {_ADD};
    RETURN NULL;
END
$$
"""
PG_TRIGGER = """
CREATE TRIGGER trg_embedding_records_usage AFTER INSERT ON embedding_records
REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION usage_daily_add_embeddings()
"""
SQLITE_TRIGGER = f"""
CREATE TRIGGER trg_embedding_records_usage AFTER INSERT ON embedding_records
BEGIN
    INSERT INTO usage_daily {_COLUMNS}
    VALUES (NEW.user_id, date(NEW.created_at), 0, 0, 0, 0, 1, NEW.prompt_tokens)
    {_ADD};
END
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "embedding_records",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("inputs", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_embedding_records_user_id_users"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_embedding_records")),
        sa.UniqueConstraint("request_id", name=op.f("uq_embedding_records_request_id")),
    )
    op.create_index("ix_embedding_records_user_id_created_at", "embedding_records", ["user_id", "created_at"])
    # plain ALTER TABLE on both dialects (SQLite adds a column with a constant default in place): a
    # batch copy of the table would drop the triggers that usage_day_totals is kept by
    for column in _USAGE_COLUMNS:
        op.add_column("usage_daily", sa.Column(column, sa.BigInteger(), nullable=False, server_default="0"))
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(PG_TRIGGER)
    else:
        op.execute(SQLITE_TRIGGER)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    on = " ON embedding_records" if dialect == "postgresql" else ""
    op.execute("DROP TRIGGER IF EXISTS trg_embedding_records_usage" + on)
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS usage_daily_add_embeddings()")
    for column in reversed(_USAGE_COLUMNS):  # SQLite 3.35+ drops a column in place, triggers kept
        op.execute(f"ALTER TABLE usage_daily DROP COLUMN {column}")
    op.drop_index("ix_embedding_records_user_id_created_at", table_name="embedding_records")
    op.drop_table("embedding_records")
