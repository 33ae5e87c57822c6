"""The registry's audit trail: ``registry_audit``, one hash-chained, signed entry per change to
users, API keys, key versions and message IDs, and ``registry_audit_head``, the one row holding the
last entry's sequence number and hash (appends take turns on it; a verifier compares it with the
last entry).

The head starts at sequence 0 with the genesis hash (64 zeros): changes made before this revision
were never recorded, and none is invented here (an entry is signed by the gateway when it is
written, and a migration holds no signing key).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-09 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the prev_hash of the first entry, and the head's hash while the trail is empty
GENESIS_HASH = "0" * 64


def upgrade() -> None:
    op.create_table(
        "registry_audit",
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=False),
        sa.Column("actor_user_id", sa.Integer(), nullable=True),
        sa.Column("actor_name", sa.String(length=200), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target_type", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=64), nullable=False),
        sa.Column("changes", sa.JSON(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("entry_hash", sa.String(length=64), nullable=False),
        sa.Column("signing_key_id", sa.String(length=32), nullable=False),
        sa.Column("signature", sa.String(length=128), nullable=False),
        sa.CheckConstraint("actor_kind IN ('api', 'cli', 'system')", name=op.f("ck_registry_audit_actor_kind")),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_registry_audit")),
    )
    op.create_index(op.f("ix_registry_audit_created_at"), "registry_audit", ["created_at"], unique=False)
    op.create_index(op.f("ix_registry_audit_actor_user_id"), "registry_audit", ["actor_user_id"], unique=False)
    op.create_index(op.f("ix_registry_audit_action"), "registry_audit", ["action"], unique=False)
    op.create_index(
        "ix_registry_audit_target_type_target_id", "registry_audit", ["target_type", "target_id"], unique=False
    )
    head = op.create_table(
        "registry_audit_head",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("entry_hash", sa.String(length=64), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_registry_audit_head_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_registry_audit_head")),
    )
    op.bulk_insert(head, [{"id": 1, "seq": 0, "entry_hash": GENESIS_HASH}])


def downgrade() -> None:
    op.drop_table("registry_audit_head")
    op.drop_index("ix_registry_audit_target_type_target_id", table_name="registry_audit")
    op.drop_index(op.f("ix_registry_audit_action"), table_name="registry_audit")
    op.drop_index(op.f("ix_registry_audit_actor_user_id"), table_name="registry_audit")
    op.drop_index(op.f("ix_registry_audit_created_at"), table_name="registry_audit")
    op.drop_table("registry_audit")
