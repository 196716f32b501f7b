"""History keeps the co-activation summary a window carried (`CoactivationSummary.to_bytes`).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("history") as batch:
        batch.add_column(sa.Column("coactivation", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("history") as batch:
        batch.drop_column("coactivation")
