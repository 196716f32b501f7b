"""Deployments remember their last processed window: its key and its answer, so the same window sent again (by
each rank of an engine) gets that answer and changes nothing (`eplb.deployments.process_window`).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("last_window_key", sa.String(64), nullable=True))
        batch.add_column(sa.Column("last_window_answer", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("last_window_answer")
        batch.drop_column("last_window_key")
