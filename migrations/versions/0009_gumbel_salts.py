"""key_versions.salts: how many salts a distortion-free key version's answers draw from.

A ``gumbel`` key version with ``salts`` S > 1 writes each answer under one of S salts (the user's
consecutive answers under consecutive salts), so one user's answers to one prompt differ as
unwatermarked answers do; the decoders of /trace try every salt
(``xmark_core.WatermarkParams.salts``). Every existing key version had no salt: 1.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("key_versions") as batch:
        batch.add_column(sa.Column("salts", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("key_versions") as batch:
        batch.drop_column("salts")
