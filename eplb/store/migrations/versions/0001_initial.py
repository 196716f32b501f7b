"""Initial schema: deployments, their history, jobs.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deployments",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("phy2log", sa.LargeBinary(), nullable=True),
        sa.Column("shares", sa.LargeBinary(), nullable=True),
        sa.Column("windows", sa.Integer(), nullable=False),
        sa.Column("last_rebalance", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "history",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("deployment", sa.String(100), sa.ForeignKey("deployments.name", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("window_digest", sa.String(64), nullable=True),
        sa.Column("window_layers", sa.Integer(), nullable=True),
        sa.Column("window_experts", sa.Integer(), nullable=True),
        sa.Column("window_tokens", sa.Float(), nullable=True),
        sa.Column("lb_before", sa.Float(), nullable=True),
        sa.Column("lb_after", sa.Float(), nullable=True),
        sa.Column("time_before_us", sa.Float(), nullable=True),
        sa.Column("time_after_us", sa.Float(), nullable=True),
        sa.Column("moves", sa.Integer(), nullable=True),
        sa.Column("bytes_moved", sa.Float(), nullable=True),
        sa.Column("solver", sa.String(40), nullable=True),
        sa.Column("solver_status", sa.String(40), nullable=True),
        sa.Column("wall_ms", sa.Float(), nullable=True),
        sa.Column("loads", sa.LargeBinary(), nullable=True),
        sa.Column("phy2log", sa.LargeBinary(), nullable=True),
        sa.Column("shares", sa.LargeBinary(), nullable=True),
    )
    op.create_index("ix_history_deployment_id", "history", ["deployment", "id"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("lease_until", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])


def downgrade() -> None:
    op.drop_table("jobs")
    op.drop_table("history")
    op.drop_table("deployments")
