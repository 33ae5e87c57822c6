"""Signed trace reports: every trace gets a public report id, the SHA-256 of the text it read, the
key version's fingerprint and parameters, the decoder's settings, the gateway version, the
canonical signed payload and its Ed25519 signature (with the signing key's id).

Traces recorded before this revision get a report id (so the audit log can name them) and no
signature: the fields a signature would cover (the text's hash above all) were never stored.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 00:00:00
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, type) of the nullable columns: NULL on the traces recorded before signed reports
REPORT_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[object]], ...] = (
    ("text_sha256", sa.String(64)),
    ("key_version_fingerprint", sa.String(64)),
    ("params", sa.Text()),
    ("decoder_settings", sa.Text()),
    ("gateway_version", sa.String(64)),
    ("report_payload", sa.Text()),
    ("signature", sa.String(128)),
    ("signing_key_id", sa.String(32)),
)


def upgrade() -> None:
    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("report_id", sa.String(32), nullable=True))
        for name, type_ in REPORT_COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
    # existing rows: one random id each ("trc_" + 24 URL-safe characters, as the gateway issues)
    connection = op.get_bind()
    traces = sa.table("traces", sa.column("id", sa.Integer()), sa.column("report_id", sa.String(32)))
    ids = [row[0] for row in connection.execute(sa.select(traces.c.id).where(traces.c.report_id.is_(None)))]
    for trace_id in ids:
        connection.execute(
            traces.update().where(traces.c.id == trace_id).values(report_id="trc_" + secrets.token_urlsafe(18))
        )
    with op.batch_alter_table("traces") as batch:
        batch.alter_column("report_id", existing_type=sa.String(32), nullable=False)
        batch.create_unique_constraint("uq_traces_report_id", ["report_id"])
        batch.create_index("ix_traces_created_at", ["created_at"])


def downgrade() -> None:
    with op.batch_alter_table("traces") as batch:
        batch.drop_index("ix_traces_created_at")
        batch.drop_constraint("uq_traces_report_id", type_="unique")
        for name, _ in reversed(REPORT_COLUMNS):
            batch.drop_column(name)
        batch.drop_column("report_id")
