"""The store on real databases (SQLite file and a throwaway PostgreSQL): migrations from empty and from the
previous revision, models equal to migrations, compact array blobs, the per-deployment write lock."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from eplb.errors import EplbError
from eplb.store import Base, DeploymentRow, HistoryRow, make_engine, migrate, open_store
from eplb.store.arrays import pack, unpack
from tests.db_fixtures import db_url_fixture, postgres_fixture  # noqa: F401

HEAD = "0003"


def revision(url: str) -> str | None:
    engine = make_engine(url)
    with engine.connect() as conn:
        rev = MigrationContext.configure(conn).get_current_revision()
    engine.dispose()
    return rev


def test_migrates_an_empty_database_to_the_models(db_url: str) -> None:
    store = open_store(db_url)
    try:
        assert revision(db_url) == HEAD
        assert {"deployments", "history", "jobs"} <= set(inspect(store.engine).get_table_names())
        with store.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        open_store(db_url).close()  # a second start finds nothing to do
        assert revision(db_url) == HEAD
    finally:
        store.close()


def test_migrates_from_the_previous_revision_keeping_rows(db_url: str) -> None:
    engine = make_engine(db_url)
    migrate(engine, "0001")
    assert "plan" not in {c["name"] for c in inspect(engine).get_columns("history")}
    window = pack(np.arange(16, dtype=np.float64).reshape(2, 8))
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO deployments (name, config, windows, created_at, updated_at) "
                          "VALUES ('old', :config, 1, 1.0, 1.0)"), {"config": json.dumps({"model": "x"})})
        conn.execute(text("INSERT INTO history (deployment, seq, at, action, reason, loads) "
                          "VALUES ('old', 1, 1.0, 'kept', 'before 0002', :w)"), {"w": window})
    migrate(engine)
    engine.dispose()
    assert revision(db_url) == HEAD
    store = open_store(db_url)
    try:
        with store.write() as session:
            row = session.query(HistoryRow).one()
            assert (row.reason, row.plan) == ("before 0002", None)
            assert unpack(row.loads or b"").tolist() == np.arange(16.0).reshape(2, 8).tolist()
            row.plan = {"stages": [[{"layer": 0, "expert": 3}]]}
        with store.read() as session:
            assert session.query(HistoryRow).one().plan == {"stages": [[{"layer": 0, "expert": 3}]]}
            deployment = session.get(DeploymentRow, "old")
            assert deployment is not None and deployment.config == {"model": "x"}
    finally:
        store.close()


def test_downgrade_drops_the_plan_column_and_upgrade_restores_it(db_url: str) -> None:
    from alembic import command

    from eplb.store.engine import alembic_config

    engine = make_engine(db_url)
    migrate(engine)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0001")
    assert "plan" not in {c["name"] for c in inspect(engine).get_columns("history")}
    migrate(engine)
    assert "plan" in {c["name"] for c in inspect(engine).get_columns("history")}
    engine.dispose()


def test_replicas_starting_together_migrate_once(db_url: str) -> None:
    errors: list[BaseException] = []

    def start() -> None:
        try:
            open_store(db_url).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert revision(db_url) == HEAD


def test_deployment_lock_serializes_read_modify_write(db_url: str) -> None:
    """Two writers increment one deployment's counter with a pause between read and write: with the lock no
    increment is lost, on SQLite (BEGIN IMMEDIATE) and PostgreSQL (SELECT ... FOR UPDATE)."""
    store = open_store(db_url)
    with store.write() as session:
        session.add(DeploymentRow(name="d", config={}, windows=0, created_at=0.0, updated_at=0.0))

    def bump() -> None:
        with store.write() as session:
            row = store.lock_deployment(session, "d")
            assert row is not None
            seen = row.windows
            time.sleep(0.2)
            row.windows = seen + 1

    threads = [threading.Thread(target=bump) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with store.read() as session:
        row = session.get(DeploymentRow, "d")
        assert row is not None and row.windows == 3
    store.close()


def test_arrays_are_compact_and_exact() -> None:
    rng = np.random.default_rng(0)
    window = np.floor(rng.gamma(0.7, 2000.0, size=(61, 256)))
    blob = pack(window)
    back = unpack(blob)
    assert back.dtype == np.float64 and back.shape == (61, 256)
    assert np.array_equal(back, window)
    assert len(blob) * 3 < len(json.dumps(window.tolist()))
    phy2log = rng.integers(0, 256, size=(61, 288))
    assert np.array_equal(unpack(pack(phy2log)), phy2log)


@pytest.mark.parametrize("url, message", [
    ("mysql://u@h/db", "unsupported database 'mysql'"),
    ("not a url", "not a database URL"),
])
def test_bad_database_urls_are_one_line_errors(url: str, message: str) -> None:
    with pytest.raises(EplbError, match=message):
        make_engine(url)
