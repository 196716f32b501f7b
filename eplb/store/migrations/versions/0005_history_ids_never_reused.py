"""History ids are never handed out twice: SQLite's `history` table gets AUTOINCREMENT.

Without it SQLite gives a new row the largest id in the table plus one, so deleting a deployment (its history rows
cascade) whose entries were the newest made the next deployment's entries take the same ids, and anything kept by
a history id (`eplb.deployments.window_coactivation(store, history_id)`, a client's `history_id`) read another
deployment's entry. AUTOINCREMENT keeps the largest id ever used (`sqlite_sequence`; the copy below seeds it with
the largest id the table holds now). PostgreSQL's sequence never reuses an id: nothing to do there.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _recreate_history(autoincrement: bool) -> None:
    """Copy SQLite's history table into one created with (or without) AUTOINCREMENT, rows, index and foreign key
    kept (Alembic's batch mode: create, copy, drop, rename)."""
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("history", recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}):
        pass


def upgrade() -> None:
    _recreate_history(True)


def downgrade() -> None:
    _recreate_history(False)
