"""EPLB_DATA_DIR or EPLB_DATABASE_URL set but empty (an unset variable expanded, `EPLB_DATA_DIR=$DIR`) is refused,
naming it, by every reader of the store settings: `eplb serve` put eplb.db in the directory it was started from, or
opened SQLite instead of the PostgreSQL database meant, silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from eplb.errors import SETTING_REFUSED
from eplb.store.engine import StoreSettings


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_data_dir_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("EPLB_DATA_DIR", value)
    with pytest.raises(ValidationError) as refused:
        StoreSettings()
    (error,) = refused.value.errors()
    assert error["type"] == SETTING_REFUSED and "leave EPLB_DATA_DIR unset" in error["msg"], error


def test_a_data_dir_is_taken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EPLB_DATA_DIR", str(tmp_path))
    assert StoreSettings().data_dir == tmp_path
    monkeypatch.delenv("EPLB_DATA_DIR")
    assert StoreSettings().data_dir.name == "eplb"  # the default


def test_eplb_serve_refuses_an_empty_data_dir_before_it_creates_anything(tmp_path: Path) -> None:
    env = {**os.environ, "EPLB_DATA_DIR": ""}
    env.pop("EPLB_DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-m", "eplb.cli", "serve", "--port", "18214"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "eplb serve: error: EPLB_DATA_DIR='': give a directory, or leave EPLB_DATA_DIR unset for the default "
        "(~/.local/share/eplb, or $XDG_DATA_HOME/eplb)"), done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_database_url_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """EPLB_DATABASE_URL=$PG_URL with PG_URL unset opened a SQLite file instead, silently: replicas meant to share
    one PostgreSQL database each kept deployments of their own."""
    monkeypatch.setenv("EPLB_DATABASE_URL", value)
    with pytest.raises(ValidationError) as refused:
        StoreSettings()
    (error,) = refused.value.errors()
    assert error["type"] == SETTING_REFUSED and "leave EPLB_DATABASE_URL unset" in error["msg"], error
    monkeypatch.setenv("EPLB_DATABASE_URL", "sqlite:////tmp/x.db")
    assert StoreSettings().database_url == "sqlite:////tmp/x.db"
