"""End-user slots: rows of ``end_users`` drawn ahead with their message IDs, for a first sight to
take without a statement (``service.end_users.reserve``). ``identifier`` becomes nullable (a slot
has none until a first sight claims it), ``status`` admits ``reserved``, ``void`` (given back
unused) and ``merged`` (its first sight lost a race for its identifier to another replica), and
``merged_into`` names the end user a merged row's texts name.

Downgrading refuses while any slot row exists (their message IDs may be carried by texts).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-21 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = "status IN ('active', 'disabled', 'deleted')"
NEW_STATUSES = "status IN ('active', 'disabled', 'deleted', 'reserved', 'void', 'merged')"


def upgrade() -> None:
    # end_users has no triggers: SQLite's copy of the table loses nothing
    with op.batch_alter_table("end_users") as batch:
        batch.alter_column("identifier", existing_type=sa.String(length=256), nullable=True)
        batch.drop_constraint(op.f("ck_end_users_status"), type_="check")
        batch.create_check_constraint(op.f("ck_end_users_status"), NEW_STATUSES)
        batch.add_column(sa.Column("merged_into", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_end_users_merged_into_end_users"), "end_users", ["merged_into"], ["id"], ondelete="RESTRICT"
        )


def downgrade() -> None:
    slots = op.get_bind().scalar(sa.text("SELECT count(*) FROM end_users WHERE identifier IS NULL"))
    if slots:
        raise RuntimeError(
            f"{slots} end-user slot rows hold message IDs that texts may carry; "
            "downgrading below 0016 would lose them. Keep the database at 0016 or later."
        )
    with op.batch_alter_table("end_users") as batch:
        batch.drop_constraint(op.f("fk_end_users_merged_into_end_users"), type_="foreignkey")
        batch.drop_column("merged_into")
        batch.drop_constraint(op.f("ck_end_users_status"), type_="check")
        batch.create_check_constraint(op.f("ck_end_users_status"), OLD_STATUSES)
        batch.alter_column("identifier", existing_type=sa.String(length=256), nullable=False)
