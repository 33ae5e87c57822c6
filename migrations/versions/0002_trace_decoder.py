"""traces.decoder: which decoder decided a trace (counting or likelihood).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("decoder", sa.String(length=16), nullable=False, server_default="counting"))


def downgrade() -> None:
    with op.batch_alter_table("traces") as batch:
        batch.drop_column("decoder")
