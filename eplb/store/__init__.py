"""Where deployments, their history and jobs are kept: SQLAlchemy 2 on SQLite (default, a file under
EPLB_DATA_DIR) or PostgreSQL (EPLB_DATABASE_URL), schema managed by the Alembic revisions shipped in
`eplb/store/migrations` and applied by `open_store` (`open_existing` opens a store to read only: it creates and
migrates nothing).

Writes are serialized per deployment: `Store.write()` opens a transaction that, on SQLite, starts with
`BEGIN IMMEDIATE` (the database's write lock, taken up front so two writers never deadlock on upgrade),
and `lock_deployment` adds `SELECT ... FOR UPDATE` on PostgreSQL (a row lock held until commit;
`create_or_lock_deployment` inserts the row first when there is none, so there is a row to lock)."""

from eplb.store.engine import (
    Conflict,
    MissingDatabase,
    Store,
    StoreSettings,
    database_url,
    make_engine,
    migrate,
    open_existing,
    open_store,
)
from eplb.store.models import Base, DeploymentRow, HistoryRow, JobRow

__all__ = [
    "Base",
    "Conflict",
    "DeploymentRow",
    "HistoryRow",
    "JobRow",
    "MissingDatabase",
    "Store",
    "StoreSettings",
    "database_url",
    "make_engine",
    "migrate",
    "open_existing",
    "open_store",
]
