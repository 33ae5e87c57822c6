"""Provenance sketches: every generation record may carry a keyed content sketch of its text
(``sketch_terms``: content-word hashes; ``sketch_minhash``: a MinHash of its word shingles), so that
``/trace`` can find the logged completions a suspect text came from.

PostgreSQL: int4[] columns, a GIN index on the terms (``gin__int_ops`` of the ``intarray`` contrib
module, which also gives the overlap count ``icount(a & b)`` the search ranks by), and a larger
statistics target on the terms so ``pg_stats`` knows the most common ones (the search skips them).
SQLite: the arrays are JSON text, and a postings table (term, generation) kept by triggers serves
the lookups and the document frequencies.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE_TRIGGERS = (
    """
    CREATE TRIGGER trg_generations_sketch_insert AFTER INSERT ON generations
    WHEN NEW.sketch_terms IS NOT NULL
    BEGIN
        INSERT OR IGNORE INTO provenance_postings (term, generation_id)
        SELECT value, NEW.id FROM json_each(NEW.sketch_terms);
    END
    """,
    """
    CREATE TRIGGER trg_generations_sketch_update AFTER UPDATE OF sketch_terms ON generations
    BEGIN
        DELETE FROM provenance_postings WHERE generation_id = OLD.id;
        INSERT OR IGNORE INTO provenance_postings (term, generation_id)
        SELECT value, NEW.id FROM json_each(NEW.sketch_terms) WHERE NEW.sketch_terms IS NOT NULL;
    END
    """,
)


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute("CREATE EXTENSION IF NOT EXISTS intarray")
        op.add_column("generations", sa.Column("sketch_terms", postgresql.ARRAY(sa.Integer()), nullable=True))
        op.add_column("generations", sa.Column("sketch_minhash", postgresql.ARRAY(sa.Integer()), nullable=True))
        op.execute(
            "CREATE INDEX ix_generations_sketch_terms ON generations USING gin (sketch_terms gin__int_ops) "
            "WHERE sketch_terms IS NOT NULL"
        )
        op.execute("ALTER TABLE generations ALTER COLUMN sketch_terms SET STATISTICS 1000")
        return
    with op.batch_alter_table("generations") as batch:
        batch.add_column(sa.Column("sketch_terms", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("sketch_minhash", sa.JSON(), nullable=True))
    op.create_table(
        "provenance_postings",
        sa.Column("term", sa.Integer(), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("term", "generation_id", name="pk_provenance_postings"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_provenance_postings_generation_id", "provenance_postings", ["generation_id"])
    for trigger in SQLITE_TRIGGERS:
        op.execute(trigger)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_generations_sketch_terms")
        op.drop_column("generations", "sketch_minhash")
        op.drop_column("generations", "sketch_terms")
        return
    op.execute("DROP TRIGGER IF EXISTS trg_generations_sketch_update")
    op.execute("DROP TRIGGER IF EXISTS trg_generations_sketch_insert")
    op.drop_index("ix_provenance_postings_generation_id", table_name="provenance_postings")
    op.drop_table("provenance_postings")
    with op.batch_alter_table("generations") as batch:
        batch.drop_column("sketch_minhash")
        batch.drop_column("sketch_terms")
