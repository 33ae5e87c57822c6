"""Two encoders per key version: a per-request version's biasing companion, and the encoder of each
generation.

A key version of the configured scheme ``auto`` carries a distortion-free primary (the columns it
always had) and a biasing companion (``xmark_core.encoders``) with parameters and a fingerprint of
its own; every existing version has one scheme (NULL companion). ``generations.encoder`` names the
scheme of the encoder that wrote a completion; NULL on earlier records (the version's one scheme).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COMPANION = (
    ("companion_scheme", sa.String(32)),
    ("companion_block_bits", sa.Integer()),
    ("companion_num_keys", sa.Integer()),
    ("companion_delta", sa.Float()),
    ("companion_min_entropy", sa.Float()),
    ("companion_fingerprint", sa.String(64)),
)


def upgrade() -> None:
    with op.batch_alter_table("key_versions") as batch:
        for name, kind in _COMPANION:
            batch.add_column(sa.Column(name, kind, nullable=True))
    with op.batch_alter_table("generations") as batch:
        batch.add_column(sa.Column("encoder", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("generations") as batch:
        batch.drop_column("encoder")
    with op.batch_alter_table("key_versions") as batch:
        for name, _ in reversed(_COMPANION):
            batch.drop_column(name)
