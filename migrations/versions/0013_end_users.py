"""End users: ``end_users``, an account's own users named by the identifier its platform sends
(``safety_identifier``, ``user``, Anthropic's ``metadata.user_id``), unique per account; their
message IDs live in ``message_ids`` beside the accounts' (``end_user_id``; ``user_id`` becomes
nullable, exactly one of the two is set), so one unique constraint per length keeps every ID of
the registry distinct. ``generations.end_user_id`` keeps the end user a completion was generated
for, ``traces.attributed_end_user_id`` the end user a trace named.

Downgrading drops the end users with their message IDs (their generation records and traces stay,
without the end user).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-16 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "end_users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("identifier", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("status IN ('active', 'disabled', 'deleted')", name=op.f("ck_end_users_status")),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_end_users_user_id_users"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_end_users")),
        sa.UniqueConstraint("user_id", "identifier", name="uq_end_users_user_id_identifier"),
    )
    op.create_index("ix_end_users_user_id_created_at", "end_users", ["user_id", "created_at"], unique=False)
    # message_ids has no triggers: SQLite's copy of the table loses nothing
    with op.batch_alter_table("message_ids") as batch:
        batch.alter_column("user_id", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("end_user_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_message_ids_end_user_id_end_users"), "end_users", ["end_user_id"], ["id"], ondelete="RESTRICT"
        )
        batch.create_unique_constraint(
            "uq_message_ids_end_user_id_bits_block_bits", ["end_user_id", "bits", "block_bits"]
        )
        batch.create_check_constraint(op.f("ck_message_ids_one_owner"), "(user_id IS NULL) <> (end_user_id IS NULL)")
    _add_reference("generations", "end_user_id")
    _add_reference("traces", "attributed_end_user_id")


def _fk(table: str, column: str) -> str:
    return f"fk_{table}_{column}_end_users"


def _triggers(table: str) -> list[str]:
    """SQLite: the statements that create ``table``'s triggers (a table copy drops them)."""
    rows = op.get_bind().execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :table"), {"table": table}
    )
    return [str(row[0]) for row in rows]


def _add_reference(table: str, column: str) -> None:
    """A nullable ``column`` of ``table`` referencing ``end_users.id``. SQLite adds a named foreign
    key only by copying the table, which drops its triggers (generations: usage, provenance
    postings): they are created again as they were."""
    if op.get_bind().dialect.name != "sqlite":
        op.add_column(table, sa.Column(column, sa.Integer(), nullable=True))
        op.create_foreign_key(op.f(_fk(table, column)), table, "end_users", [column], ["id"], ondelete="RESTRICT")
        return
    triggers = _triggers(table)
    with op.batch_alter_table(table, recreate="always") as batch:
        batch.add_column(sa.Column(column, sa.Integer(), nullable=True))
        batch.create_foreign_key(op.f(_fk(table, column)), "end_users", [column], ["id"], ondelete="RESTRICT")
    for statement in triggers:
        op.execute(statement)


def _drop_reference(table: str, column: str) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(_fk(table, column)), table, type_="foreignkey")
        op.drop_column(table, column)
        return
    triggers = _triggers(table)
    with op.batch_alter_table(table, recreate="always") as batch:
        batch.drop_constraint(op.f(_fk(table, column)), type_="foreignkey")
        batch.drop_column(column)
    for statement in triggers:
        op.execute(statement)


def downgrade() -> None:
    _drop_reference("traces", "attributed_end_user_id")
    _drop_reference("generations", "end_user_id")
    op.execute("DELETE FROM message_ids WHERE end_user_id IS NOT NULL")
    with op.batch_alter_table("message_ids") as batch:
        batch.drop_constraint(op.f("ck_message_ids_one_owner"), type_="check")
        batch.drop_constraint("uq_message_ids_end_user_id_bits_block_bits", type_="unique")
        batch.drop_constraint(op.f("fk_message_ids_end_user_id_end_users"), type_="foreignkey")
        batch.drop_column("end_user_id")
        batch.alter_column("user_id", existing_type=sa.Integer(), nullable=False)
    op.drop_index("ix_end_users_user_id_created_at", table_name="end_users")
    op.drop_table("end_users")
