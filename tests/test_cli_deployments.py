"""`eplb deployments list|show|history` and `eplb history --plot` on real databases (a SQLite file and a throwaway
PostgreSQL) and against a real `eplb serve` with an API key: read-only opens that create nothing, the paging
flags checked once for both paths, the service's refusals in the CLI's words, long names, the history plot;
`eplb serve`'s settings errors and help."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from eplb import deployments as dep
from eplb.cli import main
from eplb.errors import EplbError
from eplb.rules import MAX_HISTORY_ID
from eplb.store import Store, open_store
from tests.cli_run import error_prefix, run_eplb
from tests.db_fixtures import db_url_fixture, postgres_fixture  # noqa: F401
from tests.test_deployments import config, window
from tests.test_replicas import replica

KEY = "cli-secret"
LONG = "a" * 5000


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.close()


def _place_rebalance_apply(store: Store, name: str) -> None:
    """Register `name` (periodic, every window), place window 0, rebalance on window 1, then apply window 0's
    placement again (the cluster went back to it)."""
    dep.register(store, name, config(trigger="periodic", every=1))
    first = dep.process_window(store, name, window(0))
    dep.process_window(store, name, window(1))
    assert first.result is not None
    dep.record_applied(store, name, first.result.placement.model_dump(exclude_none=True))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A service with API key KEY and one deployment, 'web', with a rebalance and an applied placement."""
    db = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'eplb.db'}"
    store = open_store(db)
    _place_rebalance_apply(store, "web")
    store.close()
    with replica(db, api_key=KEY) as (url, _):
        yield url


READS = [["deployments", "list"], ["deployments", "show", "web"], ["deployments", "history", "web"],
         ["history", "web"], ["history", "web", "--plot", "h.png"]]


# --- read-only commands never create a database -----------------------------------------------------------------


@pytest.mark.parametrize("argv", READS)
def test_a_read_only_command_refuses_a_database_that_does_not_exist_and_creates_nothing(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.font_manager  # noqa: F401  (its cache stays where it is when HOME moves)

    monkeypatch.chdir(tmp_path)
    for var in ("EPLB_DATA_DIR", "EPLB_DATABASE_URL", "XDG_DATA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    given = "sqlite:///nonexistent/x.db"
    assert main([*argv, "--database-url", given]) == 2
    err = capsys.readouterr().err
    assert f"no database at {tmp_path / 'nonexistent' / 'x.db'} ({given}: no such file); it came from --database-url"\
        in err and "--url URL" in err and "EPLB_DATA_DIR" in err and err.count("\n") == 1
    assert main(argv) == 2  # EPLB_DATA_DIR unset: the default directory under HOME
    default = tmp_path / "home" / ".local" / "share" / "eplb"
    err = capsys.readouterr().err
    assert f"no database at {default / 'eplb.db'}" in err and "(EPLB_DATA_DIR is not set)" in err
    monkeypatch.setenv("EPLB_DATA_DIR", str(tmp_path / "data"))
    assert main(argv) == 2
    assert f"it came from EPLB_DATA_DIR='{tmp_path / 'data'}'" in capsys.readouterr().err
    assert _files(tmp_path) == [tmp_path / "home"]  # no file, no directory, no image


def test_a_database_without_the_eplb_tables_is_refused_and_left_as_it_was(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlalchemy

    if db_url.startswith("sqlite:///"):
        Path(db_url.removeprefix("sqlite:///")).touch()  # an empty file: what SQLite makes of a mistyped name
    assert main(["deployments", "list", "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    assert "has no eplb tables" in err and "--database-url" in err and "Traceback" not in err
    engine = sqlalchemy.create_engine(db_url)
    try:
        assert sqlalchemy.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_a_database_of_another_schema_revision_is_refused_not_migrated(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from eplb.store import make_engine, migrate

    engine = make_engine(db_url)
    migrate(engine, "0001")
    engine.dispose()
    assert main(["deployments", "list", "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    assert "has schema revision 0001, this eplb reads" in err and "start this version's `eplb serve`" in err
    engine = make_engine(db_url)
    with engine.connect() as conn:
        from alembic.runtime.migration import MigrationContext

        assert MigrationContext.configure(conn).get_current_revision() == "0001"
    engine.dispose()


def test_a_database_a_newer_eplb_wrote_says_to_upgrade_eplb(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A database of a revision this eplb does not ship was told to 'start this version's `eplb serve` on it', which
    cannot migrate it down (and `eplb serve` raised Alembic's CommandError)."""
    import sqlalchemy

    open_store(db_url).close()
    engine = sqlalchemy.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    engine.dispose()
    assert main(["deployments", "list", "--database-url", db_url]) == 2
    err = capsys.readouterr().err
    assert "has schema revision 9999_from_the_future, which this eplb does not know (it reads" in err, err
    assert "a newer eplb wrote it; upgrade eplb to read it" in err and "start this version" not in err
    with pytest.raises(EplbError, match=r"revision 9999_from_the_future, which this eplb does not know \(it reads "
                       r"\w+\): a newer eplb wrote it; upgrade eplb to serve it \(this one cannot migrate it down\)$"):
        open_store(db_url)  # `eplb serve`'s open: Alembic's "Can't locate revision" traceback before


# --- paging flags, the service's refusals, long names ------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--before", "-3"], f"--before must be 1 to {MAX_HISTORY_ID} (entries older than this history id, a page's "
                         "next), got -3"),
    (["--before", "0"], "--before must be 1 to"),
    (["--before", "99999999999"], "got 99999999999"),
    (["--limit", "0"], "--limit must be 1 to 1000 (entries per page), got 0"),
    (["--limit", "1001"], "got 1001"),
])
def test_paging_flags_are_refused_by_name_with_the_service_and_with_the_database(
    flags: list[str], message: str, served: str, store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dep.register(store, "web", config())
    for source in (["--url", served, "--api-key", KEY], ["--database-url", db_url]):
        assert main(["deployments", "history", "web", *flags, *source]) == 2
        err = capsys.readouterr().err
        assert message in err and "query." not in err and err.count("\n") == 1


def test_a_422_of_the_service_on_a_paging_parameter_names_the_flag(served: str) -> None:
    from eplb.cli.deployments import refusal
    from eplb.client import Client, ServiceError

    with Client(served, api_key=KEY) as client, pytest.raises(ServiceError) as raised:
        client.history("web", limit=5000, before=-3)  # what a CLI with other bounds would send
    said = str(refusal(raised.value, served, "--api-key", {"limit": 5000, "before": -3}))
    assert "query." not in said and f"--before -3: the service at {served} refuses it" in said
    assert "--limit 5000: " in said and "give 1 to 1000 (entries per page)" in said


@pytest.mark.parametrize("argv", READS)
def test_a_401_names_the_flag_and_the_variable_that_send_the_key(
    argv: list[str], served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EPLB_API_KEY", raising=False)
    assert main([*argv, "--url", served]) == 2
    err = capsys.readouterr().err
    assert f"the service at {served} needs its API key: give --api-key KEY or set EPLB_API_KEY" in err
    assert "Authorization" not in err and "Bearer" not in err
    assert main([*argv, "--url", served, "--api-key", "wrong"]) == 2
    assert f"the service at {served} refused the API key from --api-key" in capsys.readouterr().err
    monkeypatch.setenv("EPLB_API_KEY", "wrong")
    assert main([*argv, "--url", served]) == 2
    assert "refused the API key from EPLB_API_KEY" in capsys.readouterr().err
    assert main([*argv, "--url", served, "--api-key", KEY]) == 0


@pytest.mark.parametrize(("given", "env", "said"), [
    (["--api-key", "clé"], None, "--api-key (not shown) has a character that is not printable ASCII (character 3"),
    (["--api-key", ""], "right", "--api-key (not shown) is blank"),  # was taken as not given: EPLB_API_KEY sent
    ([], "key\n", "EPLB_API_KEY (not shown) ends with a newline"),
])  # fmt: skip
def test_a_key_no_request_can_carry_is_refused_naming_where_it_came_from(
    given: list[str], env: str | None, said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's refusal named its `api_key` argument, which a CLI user never wrote; nothing is sent."""
    monkeypatch.delenv("EPLB_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("EPLB_API_KEY", env)
    monkeypatch.setattr("eplb.client.Client.__init__", lambda *a, **k: pytest.fail("a client was made"))
    code, err = run_eplb(capsys, "deployments", "list", "--url", "http://127.0.0.1:9", *given)
    assert code == 2 and err.startswith(f"eplb deployments list: error: {said}"), err
    assert err.endswith(": give the key the service runs with (its EPLB_API_KEY)\n") and "clé" not in err


@pytest.mark.parametrize("argv", [["deployments", "show", LONG], ["deployments", "history", LONG],
                                  ["history", LONG, "--plot", "h.png"]])
def test_a_long_name_is_echoed_clipped(
    argv: list[str], served: str, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for source in (["--url", served], ["--database-url", db_url]):
        assert main([*argv, *source]) == 2
        err = capsys.readouterr().err
        assert len(err) < 300 and "(5,000 characters): use 1-100 letters" in err and "\u2026" in err
    assert _files(tmp_path) == []


def test_a_bad_name_gets_the_services_message_from_the_cli_and_the_client(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI clipped a bad name at 40 characters, the service and the client at 100 (`eplb.deployments.NAME_SHOWN`):
    one rule, one text (`eplb.rules.name_refusal`), whole for any name one could mean (here 60 characters)."""
    from eplb.client import Client, InvalidRequest
    from eplb.errors import FieldError
    from eplb.rules import name_refusal

    name = "a/" + "b" * 58
    text = name_refusal(name)
    assert text is not None and repr(name) in text and name_refusal("web") is None
    for argv in (["deployments", "show", name], ["history", name], ["deployments", "history", name]):
        for source in (["--url", served], ["--database-url", f"sqlite:///{tmp_path / 'none.db'}"]):
            assert main([*argv, *source]) == 2
            assert capsys.readouterr().err.strip().endswith(text), argv
    with pytest.raises(FieldError) as refused:
        dep.check_name(name)
    assert str(refused.value) == text and refused.value.fields == ("name",)
    with Client(served, api_key=KEY) as eplb, pytest.raises(InvalidRequest) as sent:
        eplb.deployment(name)
    assert str(sent.value) == text
    assert _files(tmp_path) == []


# --- list and show --------------------------------------------------------------------------------------------


def test_list_shows_the_configs_slots_before_the_first_window_and_clips_long_names(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "n" * 100
    dep.register(store, name, config())  # 8 GPUs x 10 slots, no window yet
    dep.register(store, "short", config(trigger="periodic", every=1))
    dep.process_window(store, "short", window(0))
    assert main(["deployments", "list", "--database-url", db_url]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert len({len(line) for line in (header, *rows)}) == 1  # every column where the header says
    assert rows[0].startswith("n" * 23 + "\u2026 deepseek-v2-lite") and rows[0].split()[4] == "80"
    assert rows[1].startswith("short ") and rows[1].split()[4] == "80"


def test_show_counts_in_words(store: Store, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    dep.register(store, "one", config(trigger="periodic", every=1))
    assert main(["deployments", "show", "one", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert "deployment one: 0 windows" in out and "placement: none yet (80 slots when the next window" in out
    dep.process_window(store, "one", window(0))
    assert main(["deployments", "show", "one", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert "deployment one: 1 window," in out and "on 8 GPUs, 80 slots" in out


def test_list_and_show_say_placed_for_a_deployment_never_rebalanced(
    store: Store, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A deployment whose one window placed it was listed as 'rebalanced #1' (and shown as 'last rebalance at
    window 1'): the column said rebalanced for every new placement. It says which one, from the database and from
    the service alike."""
    dep.register(store, "fresh", config(trigger="periodic", every=1))
    dep.process_window(store, "fresh", window(0))

    def columns() -> tuple[str, str]:
        assert main(["deployments", "list", "--database-url", db_url]) == 0
        _, row = capsys.readouterr().out.splitlines()
        assert main(["deployments", "show", "fresh", "--database-url", db_url]) == 0
        return row, capsys.readouterr().out.splitlines()[0]

    row, shown_ = columns()
    assert "rebalanced" not in row and row.split()[-3:-1] == ["placed", "#1"]
    assert shown_ == "deployment fresh: 1 window, placed at window 1"
    view = dep.get(store, "fresh")
    assert (view.last_rebalance, view.last_placement) == (1, "placed")
    dep.process_window(store, "fresh", window(1))
    row, shown_ = columns()
    assert row.split()[-3:-1] == ["rebalanced", "#2"] and shown_.endswith("last rebalanced at window 2")


def test_the_service_says_placed_or_rebalanced_as_the_database_does(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["deployments", "list", "--url", served, "--api-key", KEY]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert "last placement" in header and row.split()[-3:-1] == ["rebalanced", "#2"]


# --- the history plot ----------------------------------------------------------------------------------------


@pytest.fixture
def history(tmp_path: Path) -> Iterator[tuple[str, list[dep.HistoryEntry]]]:
    """A SQLite database's URL and the history of 'h': placed, rebalanced, and an applied placement in the
    rebalance's window (the cluster went back to the first placement)."""
    url = f"sqlite:///{tmp_path / 'eplb.db'}"
    store = open_store(url)
    _place_rebalance_apply(store, "h")
    yield url, dep.history(store, "h").entries
    store.close()


def test_plot_writes_exactly_the_path_given_and_refuses_a_suffix_it_cannot_write(
    history: tuple[str, list[dep.HistoryEntry]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = history
    monkeypatch.chdir(tmp_path)
    assert main(["history", "h", "--database-url", url, "--plot", "x"]) == 0
    assert capsys.readouterr().out == "wrote x (PNG, 3 events)\n"
    assert (tmp_path / "x").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "x.png").exists()
    assert main(["history", "h", "--database-url", url, "--plot", "h.svg"]) == 0
    assert "wrote h.svg (SVG, 3 events)" in capsys.readouterr().out
    assert (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")
    assert main(["history", "h", "--database-url", url, "--plot", "h.txt"]) == 2
    err = capsys.readouterr().err
    assert "--plot 'h.txt': .txt is no image format matplotlib writes; give a name ending in .png" in err
    assert not (tmp_path / "h.txt").exists()


def test_the_plot_draws_the_applied_lb_and_side_by_side_bars_on_whole_windows(
    history: tuple[str, list[dep.HistoryEntry]]
) -> None:
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    from eplb.cli.deployments import history_figure

    _, entries = history
    applied = [e for e in entries if e.action == "applied"]
    assert len(applied) == 1 and applied[0].seq == 2 and applied[0].lb_after is not None
    fig = history_figure("h", entries)
    try:
        fig.canvas.draw()
        top, bottom = fig.axes
        points = np.concatenate([np.column_stack([np.asarray(line.get_xdata(), dtype=float),
                                                  np.asarray(line.get_ydata(), dtype=float)])
                                 for line in top.get_lines()])
        assert np.isclose(points, [2.0, applied[0].lb_after]).all(axis=1).any()  # the applied placement's lb
        assert all(float(t).is_integer() for t in bottom.get_xticks())
        assert all(float(t).is_integer() for t in bottom.get_yticks())
        bars = sorted((b.get_x(), b.get_x() + b.get_width(), b.get_facecolor()) for b in bottom.patches
                      if isinstance(b, Rectangle))
        assert len(bars) == 3
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(bars))  # none over another
        assert len({c for _, _, c in bars}) == 3  # placed, rebalanced, applied: three colours
        assert bars[1][1] > 1.5 and bars[2][0] < 2.5  # window 2's two events share its slot
        for ax in (top, bottom):
            legend = ax.get_legend()
            assert legend is not None
            box = legend.get_window_extent()
            assert box.x0 >= ax.get_window_extent().x1  # right of the axes: covers no bar, no line
        assert np.isclose(top.get_lines()[0].get_xdata(), [1, 2]).all()
    finally:
        plt.close(fig)


# --- eplb serve ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--workers", "0"], {}, "--workers 0: give a whole number >= 1 (solver processes)"),
    ([], {"EPLB_QUEUE_LIMIT": "abc"}, "EPLB_QUEUE_LIMIT='abc': give a whole number >= 0 (solves that may wait"),
    ([], {"EPLB_SOLVER_WORKERS": "-1"}, "EPLB_SOLVER_WORKERS='-1': give a whole number >= 1"),
    ([], {"EPLB_JOB_LEASE_S": "abc"}, "EPLB_JOB_LEASE_S='abc': give a number > 0 and <= 3600 (job lease"),
    ([], {"EPLB_API_KEY": ""}, "EPLB_API_KEY='': give a key that is not blank, or leave EPLB_API_KEY unset for a "
     "service that asks for none\n"),
    ([], {"EPLB_API_KEY": " \t"}, "EPLB_API_KEY=' \\t': give a key that is not blank"),
    ([], {"EPLB_API_KEY": "s3cret-value\n"}, "EPLB_API_KEY: the key (not shown) ends with a newline: HTTP strips"),
    ([], {"EPLB_API_KEY": "\ts3cret-value "}, "EPLB_API_KEY: the key (not shown) starts with a tab and ends with a "
     "space: HTTP strips"),
    ([], {"EPLB_INLINE_SOLVERS": "milp"}, "EPLB_INLINE_SOLVERS='milp': 'milp' cannot run in the server process; give "
     "a comma-separated list of some of greedy, deepseek, incremental, or nothing (every request in the solver "
     "processes)\n"),
    ([], {"EPLB_INLINE_SOLVERS": "greedy,bogus"}, "EPLB_INLINE_SOLVERS='greedy,bogus': 'bogus' cannot run in the"),
    ([], {"EPLB_INLINE_SOLVERS": "greedy,,greedy"}, "EPLB_INLINE_SOLVERS='greedy,,greedy': an item is empty; give"),
    ([], {"EPLB_INLINE_SOLVERS": "greedy-coact, "}, "EPLB_INLINE_SOLVERS='greedy-coact, ': 'greedy-coact' cannot run "
     "in the server process and an item is empty; give"),
])
def test_serve_names_the_flag_or_variable_of_a_bad_setting_and_what_it_takes(
    argv: list[str], env: dict[str, str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPLB_DATA_DIR", str(tmp_path / "data"))
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main(["serve", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb serve: error: {message}") and err.count("\n") == 1
    assert "bad setting" not in err and not (tmp_path / "data").exists() and "s3cret" not in err


def test_a_blank_api_key_is_refused_wherever_settings_are_read() -> None:
    """A blank key would switch the check on and let `Authorization: Bearer` (empty) through: no app gets one."""
    from pydantic import ValidationError

    from api.settings import Settings

    for key in ("", "   "):
        with pytest.raises(ValidationError, match="give a key that is not blank"):
            Settings(api_key=key)
    assert Settings(api_key="k").api_key == "k" and Settings().api_key is None


def test_the_fast_lane_takes_only_the_solvers_allowed_in_the_server_process() -> None:
    """api.inline.SOLVERS is the one list: the default names all of it, any other solver (the MILP's OR-Tools above
    all) is refused wherever settings are read, and spaces around names or an empty setting are fine."""
    from pydantic import ValidationError

    from api.inline import SOLVERS
    from api.settings import Settings
    from solvers import registry

    assert Settings().inline == frozenset(SOLVERS) and set(SOLVERS) < set(registry.names())
    assert Settings(inline_solvers=" greedy , deepseek").inline == {"greedy", "deepseek"}
    assert Settings(inline_solvers="").inline == Settings(inline_solvers="  ").inline == frozenset()
    for name in sorted(set(registry.names()) - set(SOLVERS)):
        with pytest.raises(ValidationError, match=f"'{name}' cannot run in the server process"):
            Settings(inline_solvers=f"greedy,{name}")


def test_serve_help_says_which_routes_need_the_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    from api.middleware import GUARDED

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "POST routes" not in text
    assert all(method in text for method in GUARDED)
    assert "GET /jobs and every /deployments route, reads too" in text and "--api-key or EPLB_API_KEY" in text


@pytest.mark.parametrize("url", ["", "localhost:8000", "http://"])
def test_a_url_that_is_no_http_url_of_a_host_is_refused_naming_the_flag(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """'' read the database instead ('No deployments'); 'localhost:8000' said 'cannot reach localhost:8000: ...
    unsupported protocol', 'http://' 'cannot reach http::' after three attempts."""
    argv = ["deployments", "list", "--url", url]
    code, err = run_eplb(capsys, *argv)
    assert code == 2 and err == (error_prefix(argv) + "--url is no http(s) URL of a host (e.g. http://127.0.0.1:8000), "
                                 f"got {url!r}\n")
