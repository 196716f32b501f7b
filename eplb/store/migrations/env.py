"""Alembic environment for the eplb store: runs on the connection `eplb.store.migrate` passes in
(`config.attributes["connection"]`), or on `sqlalchemy.url` when the alembic CLI is pointed here."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from eplb.store.engine import make_engine
from eplb.store.models import Base


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


given = context.config.attributes.get("connection")
if given is not None:
    _run(given)
else:
    engine = make_engine(context.config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
