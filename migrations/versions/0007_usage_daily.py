"""Usage per user per day kept by the database; indexes for a registry of millions (the admin's name
search, the trace registry's check for changed users).

``usage_daily`` holds one row per (user, UTC day): requests and prompt tokens counted once per
request (its choice 0), completions and completion tokens per record. Triggers on ``generations``
add every inserted record to it (a record's write retried and refused as a duplicate adds nothing),
so ``GET /admin/usage`` reads at most one row per user and day instead of every record of the
period. The upgrade fills it from the records already written. Generation records are never
deleted, so the totals stay equal to a sum over them. ``usage_day_totals`` counts the rows of each
day (a trigger on ``usage_daily``), so the number of (user, day) rows of a period, the usage API's
``total``, reads one row per day.

PostgreSQL: one statement-level trigger with a transition table (one upsert per inserted batch, its
rows in (user, day) order, so concurrent batches take the rows' locks in the same order), and a
GIN trigram index on ``users.name`` (the ``pg_trgm`` contrib module) for ``?q=`` substring search.
SQLite: a row-level trigger (its single writer needs no ordering); the name search scans.

Both: an index on ``users.updated_at``, so the trace registry's change check reads the latest
change from an index instead of every user.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SUMS = """
    count(*) FILTER (WHERE choice_index = 0),
    count(*),
    coalesce(sum(prompt_tokens) FILTER (WHERE choice_index = 0), 0),
    coalesce(sum(completion_tokens), 0)
"""
_ADD = """
    ON CONFLICT (user_id, day) DO UPDATE SET
        requests = usage_daily.requests + excluded.requests,
        completions = usage_daily.completions + excluded.completions,
        prompt_tokens = usage_daily.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = usage_daily.completion_tokens + excluded.completion_tokens
"""
_COLUMNS = "(user_id, day, requests, completions, prompt_tokens, completion_tokens)"
_PG_DAY = "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

PG_FUNCTION = f"""
CREATE FUNCTION usage_daily_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_daily {_COLUMNS}
    SELECT user_id, {_PG_DAY} AS day, {_SUMS}
    FROM added GROUP BY 1, 2 ORDER BY 2, 1
    {_ADD};
    RETURN NULL;
END
$$
"""
PG_TRIGGER = """
CREATE TRIGGER trg_generations_usage AFTER INSERT ON generations
REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION usage_daily_add()
"""
PG_BACKFILL = f"INSERT INTO usage_daily {_COLUMNS} SELECT user_id, {_PG_DAY}, {_SUMS} FROM generations GROUP BY 1, 2"
# usage_day_totals: how many (user, day) rows each day has, so the usage API's total over a period
# reads one row per day instead of counting millions
_DAY_COUNT_ADD = """
    INSERT INTO usage_day_totals (day, users) VALUES (NEW.day, 1)
    ON CONFLICT (day) DO UPDATE SET users = usage_day_totals.users + 1
"""
_DAY_COUNT_REMOVE = "UPDATE usage_day_totals SET users = users - 1 WHERE day = OLD.day"
PG_DAY_FUNCTIONS = (
    f"""
    CREATE FUNCTION usage_day_totals_add() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        {_DAY_COUNT_ADD};
        RETURN NULL;
    END
    $$
    """,
    f"""
    CREATE FUNCTION usage_day_totals_remove() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        {_DAY_COUNT_REMOVE};
        RETURN NULL;
    END
    $$
    """,
)
PG_DAY_TRIGGERS = (
    "CREATE TRIGGER trg_usage_daily_count AFTER INSERT ON usage_daily "
    "FOR EACH ROW EXECUTE FUNCTION usage_day_totals_add()",
    "CREATE TRIGGER trg_usage_daily_uncount AFTER DELETE ON usage_daily "
    "FOR EACH ROW EXECUTE FUNCTION usage_day_totals_remove()",
)
SQLITE_DAY_TRIGGERS = (
    f"CREATE TRIGGER trg_usage_daily_count AFTER INSERT ON usage_daily BEGIN {_DAY_COUNT_ADD}; END",
    f"CREATE TRIGGER trg_usage_daily_uncount AFTER DELETE ON usage_daily BEGIN {_DAY_COUNT_REMOVE}; END",
)
DAY_BACKFILL = "INSERT INTO usage_day_totals (day, users) SELECT day, count(*) FROM usage_daily GROUP BY day"
SQLITE_TRIGGER = f"""
CREATE TRIGGER trg_generations_usage AFTER INSERT ON generations
BEGIN
    INSERT INTO usage_daily {_COLUMNS}
    VALUES (
        NEW.user_id, date(NEW.created_at),
        CASE WHEN NEW.choice_index = 0 THEN 1 ELSE 0 END, 1,
        CASE WHEN NEW.choice_index = 0 THEN NEW.prompt_tokens ELSE 0 END, NEW.completion_tokens
    )
    {_ADD};
END
"""
SQLITE_BACKFILL = f"""
INSERT INTO usage_daily {_COLUMNS}
SELECT user_id, date(created_at),
       sum(CASE WHEN choice_index = 0 THEN 1 ELSE 0 END), count(*),
       sum(CASE WHEN choice_index = 0 THEN prompt_tokens ELSE 0 END), sum(completion_tokens)
FROM generations GROUP BY 1, 2
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "usage_daily",
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("day", sa.String(length=10), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("completions", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_usage_daily_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("user_id", "day", name=op.f("pk_usage_daily")),
    )
    op.create_table(
        "usage_day_totals",
        sa.Column("day", sa.String(length=10), nullable=False),
        sa.Column("users", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("day", name=op.f("pk_usage_day_totals")),
    )
    if dialect == "postgresql":
        op.execute(PG_BACKFILL)
        op.execute(DAY_BACKFILL)
        for statement in (PG_FUNCTION, PG_TRIGGER, *PG_DAY_FUNCTIONS, *PG_DAY_TRIGGERS):
            op.execute(statement)
        op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        op.execute("CREATE INDEX ix_users_name_trgm ON users USING gin (name gin_trgm_ops)")
    else:
        op.execute(SQLITE_BACKFILL)
        op.execute(DAY_BACKFILL)
        for statement in (SQLITE_TRIGGER, *SQLITE_DAY_TRIGGERS):
            op.execute(statement)
    # the usage API's order: newest day first, then user id (a page is the index's first entries)
    op.create_index("ix_usage_daily_day_user_id", "usage_daily", [sa.text("day DESC"), "user_id"])
    op.create_index("ix_users_updated_at", "users", ["updated_at"])


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    on = {"generations": " ON generations", "usage_daily": " ON usage_daily"} if dialect == "postgresql" else {}
    op.execute("DROP TRIGGER IF EXISTS trg_generations_usage" + on.get("generations", ""))
    op.execute("DROP TRIGGER IF EXISTS trg_usage_daily_count" + on.get("usage_daily", ""))
    op.execute("DROP TRIGGER IF EXISTS trg_usage_daily_uncount" + on.get("usage_daily", ""))
    if dialect == "postgresql":
        for function in ("usage_daily_add", "usage_day_totals_add", "usage_day_totals_remove"):
            op.execute(f"DROP FUNCTION IF EXISTS {function}()")
        op.execute("DROP INDEX IF EXISTS ix_users_name_trgm")
    op.drop_index("ix_users_updated_at", table_name="users")
    op.drop_index("ix_usage_daily_day_user_id", table_name="usage_daily")
    op.drop_table("usage_day_totals")
    op.drop_table("usage_daily")
