"""key_versions.min_entropy: the entropy rule a key version encodes with.

A key version made with the rule on biases only the positions where the model's min-entropy is at
least ``min_entropy`` nats (``xmark_core.WatermarkParams.min_entropy``); the likelihood decoder of
/trace reads the same rule from the row. Every existing key version biased every position: 0.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("key_versions") as batch:
        batch.add_column(sa.Column("min_entropy", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("key_versions") as batch:
        batch.drop_column("min_entropy")
