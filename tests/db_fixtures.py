"""Real databases for the store, deployment and replica tests: a SQLite file, and a throwaway PostgreSQL
cluster (Debian's server binaries, initdb + pg_ctl on a free loopback port in a temporary directory, stopped
after the session). Without PostgreSQL the PostgreSQL cases skip locally and FAIL in CI (CI=true).

Import the fixtures into a test module: `from tests.db_fixtures import db_url_fixture, postgres_fixture  # noqa: F401`
(they are named `db_url` and `postgres` for the tests)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"PostgreSQL is required in CI: {reason}")
    pytest.skip(reason)


class PostgresCluster:
    """A running throwaway cluster; `new_database()` gives a fresh, empty database's URL."""

    def __init__(self, port: int, user: str) -> None:
        self.port, self.user = port, user

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={self.user} dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # a generated identifier, not input
        return self.url(name)


@pytest.fixture(scope="session", name="postgres")
def postgres_fixture() -> Iterator[PostgresCluster]:
    """Start PostgreSQL for the session (as the `postgres` system user when run as root, which initdb
    refuses), on 127.0.0.1 with trust auth, fsync off; stop it and delete its directory afterwards."""
    bindir = _pg_bin()
    if bindir is None:
        _missing("no /usr/lib/postgresql/*/bin/initdb (apt-get install postgresql)")
        raise AssertionError  # unreachable: _missing raised
    root = Path(tempfile.mkdtemp(prefix="eplb-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        runas = "postgres"
        try:
            pwd.getpwnam(runas)
        except KeyError:
            runas = "nobody"
        shutil.chown(root, runas)
        prefix = ["runuser", "-u", runas, "--"]
    data, log, port = root / "data", root / "log", _free_port()
    user = "eplb"

    def run(*cmd: str) -> None:
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stdout}{done.stderr}")

    run(str(bindir / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8", "--no-sync")
    options = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={root} -c fsync=off " \
              "-c full_page_writes=off -c synchronous_commit=off -c max_connections=200"
    try:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
        yield PostgresCluster(port, user)
    finally:
        subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"], name="db_url")
def db_url_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, then a fresh PostgreSQL database (same test, both backends)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'eplb.db'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    return cluster.new_database()
