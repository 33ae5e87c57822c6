"""message_ids: one message ID per user and message length (bits, block_bits).

Key versions of different message lengths coexist (16-bit versions keep tracing while new ones
use 32 bits), so a user holds one ID per length in use. ``users.message_id`` stays: it is the ID
of the length the user was created with. The backfill copies it into ``message_ids``: bits =
its length, block_bits = that of the key versions with that many bits (2 when there are none).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_BLOCK_BITS = 2


def upgrade() -> None:
    op.create_table(
        "message_ids",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("bits", sa.Integer(), nullable=False),
        sa.Column("block_bits", sa.Integer(), nullable=False),
        sa.Column("message_id", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_message_ids_user_id_users"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_message_ids")),
        sa.UniqueConstraint("bits", "block_bits", "message_id", name=op.f("uq_message_ids_bits_block_bits_message_id")),
        sa.UniqueConstraint("user_id", "bits", "block_bits", name=op.f("uq_message_ids_user_id_bits_block_bits")),
    )
    _backfill()


def _backfill() -> None:
    """One row per existing user, from ``users.message_id`` (one set-based INSERT … SELECT)."""
    connection = op.get_bind()
    # the newest key version of each message length decides its block size (before this
    # revision every key version had to share one length, so there is one in practice)
    rows = connection.execute(sa.text("SELECT bits, block_bits FROM key_versions ORDER BY id")).all()
    block_bits_of = {int(bits): int(block_bits) for bits, block_bits in rows}
    users = sa.table(
        "users",
        sa.column("id", sa.Integer()),
        sa.column("message_id", sa.String()),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    message_ids = sa.table(
        "message_ids",
        sa.column("user_id", sa.Integer()),
        sa.column("bits", sa.Integer()),
        sa.column("block_bits", sa.Integer()),
        sa.column("message_id", sa.String()),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    length = sa.func.length(users.c.message_id)
    block_bits: sa.ColumnElement[int] = (
        sa.case(block_bits_of, value=length, else_=sa.literal(DEFAULT_BLOCK_BITS))
        if block_bits_of
        else sa.literal(DEFAULT_BLOCK_BITS)
    )
    select = sa.select(users.c.id, length, block_bits, users.c.message_id, users.c.created_at)
    op.execute(message_ids.insert().from_select(["user_id", "bits", "block_bits", "message_id", "created_at"], select))


def downgrade() -> None:
    # users.message_id was kept, so nothing is lost but the IDs of other lengths
    op.drop_table("message_ids")
