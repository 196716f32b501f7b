"""Shared fixtures: a real `eplb serve` process on a loopback port."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def poll_job(base: str, location: str, until: tuple[str, ...], timeout_s: float = 60) -> dict[str, Any]:
    """GET the job at `location` until its status is one of `until` (fails after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = httpx.get(f"{base}{location}", timeout=60).json()
        if job["status"] in until:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def wait_until_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Poll `eplb serve` at `base` until GET /readyz answers 200; if `proc` exits or `timeout_s` passes first, kill
    it and raise RuntimeError with what it printed (when its output is piped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"eplb serve did not start: {out}")
        time.sleep(0.2)


@contextmanager
def running_server(**env: str) -> Iterator[str]:
    """Start `eplb serve` on 127.0.0.1 with EPLB_* settings; yield its base URL; stop it. Each server keeps its
    jobs and deployments in a database of its own (a fresh EPLB_DATA_DIR) unless the settings name one."""
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix="eplb-test-")
    environ = {**os.environ, "EPLB_DATA_DIR": data_dir, **{f"EPLB_{k.upper()}": v for k, v in env.items()}}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eplb.cli", "serve", "--port", str(port), "--log-level", "warning"],
        env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    wait_until_ready(base, proc)
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server_factory() -> Iterator[Callable[..., str]]:
    """Start servers on demand, one per distinct setting, shared across the session."""
    servers: dict[tuple[tuple[str, str], ...], str] = {}
    stack: list[Iterator[str]] = []

    def get(**env: str) -> str:
        key = tuple(sorted(env.items()))
        if key not in servers:
            cm = running_server(**env)
            servers[key] = cm.__enter__()
            stack.append(cm)  # type: ignore[arg-type]
        return servers[key]

    yield get
    # stopped together: each waits for its own graceful shutdown (seconds), one after another took 17 s at the end
    with concurrent.futures.ThreadPoolExecutor(max(1, len(stack))) as stopping:
        for done in [stopping.submit(cm.__exit__, None, None, None) for cm in stack]:  # type: ignore[attr-defined]
            done.result()


def remote_mixtral_deployment(base: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment `name` of mixtral-8x7b on 4 GPUs x 4 slots (greedy, periodic) on the service at `base`, and
    the plug-ins' environment pointed at it (EPLB_SERVICE_URL, EPLB_DEPLOYMENT)."""
    import httpx

    config = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4, "slots_per_gpu": 4}, "solver": "greedy",
              "policy": {"trigger": "periodic"}}
    created = httpx.put(f"{base}/deployments/{name}", json=config, timeout=60)
    assert created.status_code in (200, 201), created.text
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", name)
