"""Engine, sessions and migrations for the store (see the package docstring)."""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.request import pathname2url

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from eplb.errors import SETTING_REFUSED, EplbError
from eplb.store.models import DeploymentRow

MIGRATIONS = Path(__file__).parent / "migrations"
_WRITE_LOCK = "eplb_write_lock"
_CREATE_ATTEMPTS = 10  # inserts of a deployment a concurrent DELETE keeps removing before it is locked
_MIGRATION_LOCK_KEY = 0x65706C62  # "eplb": pg_advisory_xact_lock key for concurrent starts
CONNECT_TIMEOUT_S = 10
"""Seconds a PostgreSQL connection may take to open unless the URL (`?connect_timeout=`) or PGCONNECT_TIMEOUT
says: libpq waits for ever by default, so a host that drops packets would hang a start-up or a request."""


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "eplb"


class StoreSettings(BaseSettings):
    """EPLB_DATABASE_URL (e.g. postgresql://user@host:5432/eplb) wins over EPLB_DATA_DIR, the directory
    of the default SQLite file `eplb.db`; EPLB_JOB_LEASE_S: seconds a replica's job lease lasts (renewed
    every third of it); a job whose owner stops renewing is marked failed."""

    model_config = SettingsConfigDict(env_prefix="EPLB_")

    database_url: str | None = Field(None, description="SQLAlchemy URL; absent: SQLite in data_dir")
    data_dir: Path = Field(default_factory=_default_data_dir, description="directory of the SQLite file")
    job_lease_s: float = Field(10.0, gt=0, le=3600, description="job lease of a replica, seconds")

    @field_validator("data_dir", "database_url", mode="before")
    @classmethod
    def _not_blank(cls, value: Any, info: ValidationInfo) -> Any:
        """An empty EPLB_DATA_DIR (`EPLB_DATA_DIR=$DIR`, DIR unset) was Path(''): eplb.db in the working directory; an
        empty EPLB_DATABASE_URL (`=$PG_URL`, PG_URL unset) opened SQLite: replicas each their own database."""
        if isinstance(value, str) and not value.strip():
            raise PydanticCustomError(SETTING_REFUSED, _BLANK[str(info.field_name)])
        return value


_BLANK = {
    "data_dir": "give a directory, or leave EPLB_DATA_DIR unset for the default (~/.local/share/eplb, or "
                "$XDG_DATA_HOME/eplb)",
    "database_url": "give a database URL (postgresql://user@host:5432/eplb), or leave EPLB_DATABASE_URL unset for "
                    "SQLite in EPLB_DATA_DIR",
}


def database_url(settings: StoreSettings | None = None) -> str:
    """The URL the store opens: EPLB_DATABASE_URL, else sqlite:///<EPLB_DATA_DIR>/eplb.db."""
    settings = settings or StoreSettings()
    if settings.database_url:
        return settings.database_url
    return f"sqlite:///{settings.data_dir.expanduser().resolve() / 'eplb.db'}"


def shown_url(url: str) -> str:
    """`url` as given, its password replaced by *** (for messages)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _reason(exc: BaseException) -> str:
    """What the database driver said, on one line (libpq puts its hint on a line of its own)."""
    orig = getattr(exc, "orig", None) or exc
    lines = [" ".join(line.split()) for line in str(orig).splitlines() if line.strip()]
    said = [line[0].lower() + line[1:] if i and line[1:2].islower() else line for i, line in enumerate(lines)]
    return "; ".join(said) or type(orig).__name__


class Conflict(EplbError):
    """A write that lost to concurrent writes of the same deployment, every attempt it made: send it again (the
    service answers 409)."""


class MissingDatabase(EplbError):
    """A read-only open (`open_existing`) found nothing to read: no SQLite file there, or a database without the
    eplb tables. The message names the database; the caller says how to point at the right one."""


def make_engine(url: str, *, read_only: bool = False) -> Engine:
    """An engine for `url`. postgresql:// means psycopg 3; a SQLite file's directory is created, unless
    `read_only`: then the file must exist (MissingDatabase), is opened read-only and nothing is created. Every
    problem is one EplbError naming the URL (without its password) and what failed."""
    shown = shown_url(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        why = _url_problem(url, exc)
        raise EplbError(f"not a database URL: {shown!r} ({why}; e.g. sqlite:////path/eplb.db or "
                        "postgresql://host/db)") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    try:
        return _read_only_engine(parsed, shown) if read_only else _engine(parsed)
    except OSError as exc:  # the SQLite file's directory
        raise EplbError(f"cannot open the database {shown}: cannot create the directory {exc.filename} "
                        f"({exc.strerror or exc})") from None
    except (ArgumentError, ImportError) as exc:  # NoSuchModuleError is an ArgumentError
        raise EplbError(f"cannot open the database {shown}: no driver {parsed.drivername!r} here ({_reason(exc)}); "
                        "use sqlite:/// or postgresql:// (psycopg)") from None
    except (DBAPIError, sqlite3.Error) as exc:
        raise EplbError(f"cannot open the database {shown}: {_reason(exc)}") from None


def _url_problem(url: str, exc: BaseException) -> str:
    """What is wrong with a URL SQLAlchemy cannot parse: a host with an unclosed IPv6 bracket (make_url then reads
    what follows its last ':' as a port), a port that is no number, or what the parser said."""
    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    if host.count("[") != host.count("]") or ("[" in host and not re.fullmatch(r"\[[^][]*\](:[^:]*)?", host)):
        return "its host is malformed: an IPv6 address needs both its brackets, as in [::1]:5432"
    return "its port is not a number" if "int()" in str(exc) else _reason(exc)


def _engine(parsed: URL) -> Engine:
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": 60, "check_same_thread": False})
        _sqlite_transactions(engine)
        _sqlite_wal(engine)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise EplbError(f"unsupported database {parsed.get_backend_name()!r}: use SQLite or PostgreSQL")
    given = "connect_timeout" in parsed.query or os.environ.get("PGCONNECT_TIMEOUT")
    timeout = {} if given else {"connect_timeout": CONNECT_TIMEOUT_S}
    return create_engine(parsed, pool_pre_ping=True, connect_args=timeout)


def _read_only_engine(parsed: URL, shown: str) -> Engine:
    """An engine that creates nothing: SQLite read-only (a missing file is MissingDatabase, never an empty new one),
    PostgreSQL as `_engine` (it creates no database).

    A SQLite file in WAL mode with its `-wal` or `-shm` beside it is open (a running service) or was left so (a
    crash): its log may hold writes the file does not, so it is read with mode=ro, through that log (SQLite creates
    the other of the two when one is missing: correctness first). Without them no connection has it open and the
    file holds everything: it is read with immutable=1, which creates nothing (mode=ro would create both and leave
    them). A service that starts on the file meanwhile and writes into it is caught (`_check_unchanged`)."""
    if parsed.get_backend_name() != "sqlite":
        return _engine(parsed)
    if parsed.database in (None, "", ":memory:"):
        raise MissingDatabase(f"{shown} is an in-memory database: it holds no deployments")
    path = Path(parsed.database).expanduser().absolute()
    if not path.is_file():
        raise MissingDatabase(f"no database at {path} ({shown}: {'not a file' if path.exists() else 'no such file'})")
    engine = create_engine(parsed)

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, record: Any, _cargs: Any, _cparams: Any) -> sqlite3.Connection:
        in_use = any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))
        if not in_use:
            record.info[_OPENED_AS] = (path, _file_state(path))  # before SQLite reads a byte
        mode = "mode=ro" if in_use else "mode=ro&immutable=1"
        return sqlite3.connect(f"file:{pathname2url(str(path))}?{mode}", uri=True, timeout=60, check_same_thread=False)

    _sqlite_transactions(engine)
    return engine


_OPENED_AS = "eplb.immutable_file"
"""The key of a connection's `info` holding (path, `_file_state`) of the SQLite file it reads with immutable=1."""


def _file_state(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is written or replaced: inode, size, mtime and ctime (ns)."""
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _check_unchanged(session: Session) -> None:
    """For a connection reading a SQLite file with immutable=1 (SQLite then trusts its pages never change): an
    EplbError when the file changed since it opened it (a service started on it and wrote into it, so what was read
    may mix two states), the connection dropped; nothing for any other connection."""
    try:
        connection = session.connection()
    except DBAPIError:
        return
    opened = connection.info.get(_OPENED_AS)
    if opened is None:
        return
    path, state = opened
    try:
        same = _file_state(path) == state
    except OSError:
        same = False
    if not same:
        connection.invalidate()
        raise EplbError(f"the database {path} changed while it was read (a service wrote into it): run the "
                        "command again")


def _sqlite_transactions(engine: Engine) -> None:
    """SQLAlchemy emits BEGIN itself (pysqlite's own is off), `BEGIN IMMEDIATE` for write sessions."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE_LOCK) else "BEGIN")


def _sqlite_wal(engine: Engine) -> None:
    """Switch the file to write-ahead logging (readers never wait for the writer); the mode is kept in the file.
    The switch needs the file to itself for a moment, so a replica starting beside another retries."""
    if engine.url.database in (None, "", ":memory:"):
        return
    for attempt in range(100):
        raw = engine.raw_connection()
        try:
            raw.cursor().execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if attempt == 99:
                raise
            time.sleep(0.05)
        finally:
            raw.close()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to `revision` with the shipped Alembic revisions, under a lock so replicas that
    start together migrate one after the other."""
    from alembic import command

    config = alembic_config()
    with engine.execution_options(**{_WRITE_LOCK: True}).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_KEY})")
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def alembic_config() -> Any:
    """An Alembic Config pointing at the shipped revisions (no alembic.ini needed)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


class Store:
    """An engine with read and write sessions. Objects stay usable after commit (expire_on_commit off)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.url = engine.url.render_as_string(hide_password=True)
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(engine.execution_options(**{_WRITE_LOCK: True}), expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads (rolled back at the end). On a SQLite file read with immutable=1 (`open_existing`),
        an EplbError when the file changed while it was read (`_check_unchanged`)."""
        with self._read() as session:
            try:
                yield session
            except DBAPIError:
                _check_unchanged(session)  # a changed file may read as garbage: say what happened
                raise
            _check_unchanged(session)

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction committed at the end (rolled back on error); holds SQLite's write lock throughout."""
        with self._write.begin() as session:
            yield session

    def lock_deployment(self, session: Session, name: str) -> DeploymentRow | None:
        """The deployment row, locked until the transaction ends (FOR UPDATE on PostgreSQL; on SQLite the
        write session's BEGIN IMMEDIATE already excludes every other writer)."""
        return session.scalars(select(DeploymentRow).where(DeploymentRow.name == name).with_for_update()).first()

    def create_or_lock_deployment(self, session: Session, name: str,
                                  columns: dict[str, Any]) -> tuple[DeploymentRow, bool]:
        """The deployment row, locked until the transaction ends (`lock_deployment`), inserted first with `columns`
        when there is none; and whether this call inserted it. The insert is ON CONFLICT DO NOTHING: on PostgreSQL
        it waits for a transaction inserting the same name, so first PUTs of one name on several replicas at once
        create it once (the others then update it), where a lock on a row not yet there locks nothing. A row a
        concurrent DELETE removed before it was locked is inserted again (the PUT comes after the DELETE and
        registers the deployment anew); `Conflict` after `_CREATE_ATTEMPTS` such losses in a row."""
        dialect = postgresql if self.dialect == "postgresql" else sqlite  # both spell ON CONFLICT alike
        for _ in range(_CREATE_ATTEMPTS):
            insert = dialect.insert(DeploymentRow).values(name=name, **columns).on_conflict_do_nothing(
                index_elements=[DeploymentRow.name])
            created = session.execute(insert.returning(DeploymentRow.name)).first() is not None
            row = self.lock_deployment(session, name)
            if row is not None:
                return row, created
            # another transaction deleted the row between the insert and the lock: insert again
        raise Conflict(f"deployment {name!r} was deleted {_CREATE_ATTEMPTS} times while it was being registered "
                       "(concurrent DELETE and PUT): send the PUT again")

    def close(self) -> None:
        self.engine.dispose()


def open_existing(url: str | None = None) -> Store:
    """Open the store at `url` (default: `database_url()`) to read it, creating and changing nothing: no file, no
    directory, no tables, no migration. MissingDatabase when there is no SQLite file or no eplb tables; EplbError
    when its schema is not this version's (an older one: `eplb serve` of this version migrates it at start; a newer
    one: upgrade eplb)."""
    from alembic.runtime.migration import MigrationContext

    url = url or database_url()
    shown = shown_url(url)
    engine = make_engine(url, read_only=True)
    try:
        with engine.connect() as conn:
            revision = MigrationContext.configure(conn).get_current_revision()
    except DBAPIError as exc:  # unreachable, refused, not a database: what the driver said, on one line
        engine.dispose()
        raise EplbError(f"cannot open the database {shown}: {_reason(exc)}") from None
    head = _head()
    if revision != head:
        engine.dispose()
        if revision is None:
            raise MissingDatabase(f"the database {shown} has no eplb tables (no eplb service has used it)")
        if not _known_revision(revision):
            raise _newer_schema(shown, revision, head, "read it, or ask the service that uses it (--url)")
        raise EplbError(f"the database {shown} has schema revision {revision}, this eplb reads {head}: start this "
                        "version's `eplb serve` on it (it migrates at start), or ask the service that uses it")
    return Store(engine)


def _head() -> str:
    """The newest shipped schema revision."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head() or "none"


def _newer_schema(shown: str, revision: str, head: str, then: str) -> EplbError:
    """The error for a database of a schema revision this eplb does not ship (a newer eplb's)."""
    return EplbError(f"the database {shown} has schema revision {revision}, which this eplb does not know (it reads "
                     f"{head}): a newer eplb wrote it; upgrade eplb to {then}")


def _known_revision(revision: str) -> bool:
    """Whether `revision` is one of the shipped Alembic revisions (an older schema than head, or head)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except CommandError:
        return False


def open_store(url: str | None = None, *, upgrade: bool = True) -> Store:
    """Open the store at `url` (default: `database_url()`), migrating it to the newest schema first (one of a
    revision this eplb does not ship, a newer eplb's, is an EplbError saying to upgrade eplb)."""
    url = url or database_url()
    engine = make_engine(url)
    if upgrade:
        from alembic.runtime.migration import MigrationContext
        from alembic.util import CommandError

        try:
            migrate(engine)
        except DBAPIError as exc:  # unreachable, refused, not a database: what the driver said, on one line
            engine.dispose()
            raise EplbError(f"cannot open the database {shown_url(url)}: {_reason(exc)}") from None
        except CommandError:  # Alembic cannot find the database's revision: a newer eplb's, it cannot go down
            with engine.connect() as conn:
                revision = MigrationContext.configure(conn).get_current_revision()
            engine.dispose()
            if revision is None or _known_revision(revision):
                raise
            down = "serve it (this one cannot migrate it down)"
            raise _newer_schema(shown_url(url), revision, _head(), down) from None
    return Store(engine)
