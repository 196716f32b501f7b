"""The store on real databases (SQLite file and a throwaway PostgreSQL): migrations from empty and from the
previous revision, models equal to migrations, compact array blobs, the per-deployment write lock."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from eplb.errors import EplbError
from eplb.store import Base, DeploymentRow, HistoryRow, make_engine, migrate, open_store
from eplb.store.arrays import pack, unpack
from tests.db_fixtures import db_url_fixture, postgres_fixture  # noqa: F401

HEAD = "0005"


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


def test_history_ids_are_never_reused_after_a_delete(db_url: str) -> None:
    """SQLite gave a new history row the largest id in the table plus one: a deployment deleted with the newest
    entries (its rows cascade) left their ids to the next deployment (create idx, post a window: history_id 22;
    delete idx, create idy, post: 22 again), so a history id could read another deployment's entry. Migration 0005
    gives the table AUTOINCREMENT, seeded with the largest id it holds; PostgreSQL's sequence never reused one."""
    from eplb import deployments as dep
    from tests.test_deployments import config, window

    engine = make_engine(db_url)
    migrate(engine, "0004")  # a database of the previous revision, its newest entries then deleted
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO deployments (name, config, windows, created_at, updated_at) "
                          "VALUES ('old', :config, 2, 1.0, 1.0)"), {"config": json.dumps({"model": "x"})})
        for seq in (1, 2):
            conn.execute(text("INSERT INTO history (deployment, seq, at, action, reason) "
                              "VALUES ('old', :seq, 1.0, 'kept', 'before 0005')"), {"seq": seq})
    migrate(engine)
    engine.dispose()
    store = open_store(db_url)
    try:
        with store.read() as session:
            assert [r.id for r in session.query(HistoryRow).order_by(HistoryRow.id)] == [1, 2]  # kept
        dep.retire(store, "old")
        with store.read() as session:
            assert session.query(HistoryRow).count() == 0  # the cascade survived the copy
        seen: list[int] = []
        for name in ("idx", "idy", "idz"):
            dep.register(store, name, config())
            seen.append(dep.process_window(store, name, window(0)).history_id)
            dep.retire(store, name)
        assert seen == [3, 4, 5], seen  # was [3, 3, 3] on SQLite
        assert "ix_history_deployment_id" in {i["name"] for i in inspect(store.engine).get_indexes("history")}
    finally:
        store.close()


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


@pytest.mark.parametrize("url", ["postgresql://[::1", "postgresql://u:secret@[fe80::1/db", "postgresql://[::1/db"])
def test_an_unclosed_ipv6_bracket_is_a_malformed_host_not_a_port(url: str) -> None:
    """make_url reads what follows the last ':' of '[::1' as a port: the message said 'its port is not a number'."""
    with pytest.raises(EplbError) as caught:
        make_engine(url)
    message = str(caught.value)
    assert "its host is malformed: an IPv6 address needs both its brackets, as in [::1]:5432" in message
    assert "port is not a number" not in message and "secret" not in message


def test_postgresql_connections_time_out_unless_the_url_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """libpq waits for ever by default: a host that drops packets hung a start-up. Connections get
    connect_timeout (CONNECT_TIMEOUT_S) unless the URL or PGCONNECT_TIMEOUT sets one."""
    import psycopg

    from eplb.store.engine import CONNECT_TIMEOUT_S

    seen: list[dict[str, object]] = []

    def connect(*args: object, **kwargs: object) -> None:
        seen.append(kwargs)
        raise psycopg.OperationalError("not here")

    monkeypatch.setattr(psycopg, "connect", connect)
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    for url in ("postgresql://u@192.0.2.1/db", "postgresql://u@192.0.2.1/db?connect_timeout=3"):
        with pytest.raises(Exception, match="not here"):
            make_engine(url).connect()
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "7")  # libpq reads it when no connect_timeout is passed
    with pytest.raises(Exception, match="not here"):
        make_engine("postgresql://u@192.0.2.1/db").connect()
    assert [k.get("connect_timeout") for k in seen] == [CONNECT_TIMEOUT_S, "3", None]
    assert CONNECT_TIMEOUT_S == 10


def _unusable_urls(tmp_path: Path) -> list[tuple[str, list[str]]]:
    """(url, what its one-line error must say) for databases that cannot be opened."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a database\n")
    return [
        ("postgresql://u:secret@127.0.0.1:1/x",  # nothing listens on port 1: refused at once
         ["cannot open the database postgresql://u:***@127.0.0.1:1/x: ", "port 1 failed: Connection refused; is the "
          "server running"]),
        ("postgresql://u:secret@127.0.0.1:abc/x", ["not a database URL: 'postgresql://u:***@127.0.0.1:abc/x' (its "
                                                   "port is not a number"]),
        ("postgresql+nodriver://u:secret@h/x", ["cannot open the database postgresql+nodriver://u:***@h/x: no driver "
                                                "'postgresql+nodriver'"]),
        (f"sqlite:///{a_file}/sub/eplb.db", [f"cannot open the database sqlite:///{a_file}/sub/eplb.db: cannot create "
                                              f"the directory {a_file}"]),
        (f"sqlite:///{a_file}", [f"cannot open the database sqlite:///{a_file}: file is not a database"]),
    ]


def test_an_unusable_database_url_is_one_line_naming_it_without_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unreachable PostgreSQL printed libpq's two lines (its hint on the second), with the driver's URL
    (postgresql+psycopg://) instead of the one given; a bad port, a missing driver, a SQLite path under a file or
    a file that is no database were tracebacks. Through `open_store` and `eplb deployments --database-url` (which
    only reads: a SQLite file that is not there is no database to it, not a directory to create)."""
    from eplb.cli import main

    for url, said in _unusable_urls(tmp_path):
        with pytest.raises(EplbError) as caught:
            open_store(url)
        message = str(caught.value)
        assert "\n" not in message and "secret" not in message, message
        assert all(part in message for part in said), message
        capsys.readouterr()
        assert main(["deployments", "list", "--database-url", url]) == 2
        err = capsys.readouterr().err
        missing = url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).parent.is_dir()
        read_only = f"no database at {url.removeprefix('sqlite:///')} ({url}: no such file)"
        assert err.count("\n") == 1 and "secret" not in err and (read_only if missing else said[0]) in err, err


def _beside(db: Path) -> list[str]:
    return sorted(p.name for p in db.parent.iterdir())


def test_a_read_only_open_creates_nothing_and_reads_a_running_services_log(tmp_path: Path) -> None:
    """`open_existing` opened SQLite with mode=ro, which creates `eplb.db-wal` and `eplb.db-shm` beside a closed WAL
    database and leaves them. Now a closed file is read with immutable=1 (nothing created), and a file a service has
    open is read through its log: a window the service has not yet written into the file is seen."""
    from eplb import deployments as dep
    from eplb.store import open_existing
    from tests.test_deployments import config, window

    db = tmp_path / "eplb.db"
    url = f"sqlite:///{db}"
    served = open_store(url)
    dep.register(served, "d", config())
    served.close()
    assert _beside(db) == ["eplb.db"]
    reader = open_existing(url)
    assert [v.name for v in dep.list_all(reader)] == ["d"] and dep.get(reader, "d").windows == 0
    reader.close()
    assert _beside(db) == ["eplb.db"]  # mode=ro left eplb.db-shm and eplb.db-wal

    served = open_store(url)  # running: its pooled connections keep the file open, the window in its log
    dep.process_window(served, "d", window(0))
    assert _beside(db) == ["eplb.db", "eplb.db-shm", "eplb.db-wal"]
    with sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True) as file_only:  # the file alone: no window yet
        assert file_only.execute("SELECT windows FROM deployments").fetchall() == [(0,)]
    file_only.close()
    reader = open_existing(url)
    assert dep.get(reader, "d").windows == 1 and dep.history_count(reader, "d") == 1
    reader.close()
    served.close()


def test_a_file_that_changes_under_an_immutable_read_is_said_so_not_misread(tmp_path: Path) -> None:
    """immutable=1 tells SQLite the file never changes: a service that starts on it and writes into it while a
    read-only store has it open (a connection in the pool caches its pages) is an EplbError, and the next read sees
    the new file."""
    from eplb import deployments as dep
    from eplb.store import open_existing
    from tests.test_deployments import config, window

    url = f"sqlite:///{tmp_path / 'eplb.db'}"
    served = open_store(url)
    dep.register(served, "d", config())
    served.close()
    reader = open_existing(url)
    assert dep.get(reader, "d").windows == 0
    served = open_store(url)
    dep.process_window(served, "d", window(0))
    served.close()  # its last connection copies the log into the file
    with pytest.raises(EplbError, match=r"^the database .*eplb\.db changed while it was read \(a service wrote into "
                       r"it\): run the command again$"):
        dep.get(reader, "d")
    assert dep.get(reader, "d").windows == 1
    reader.close()
