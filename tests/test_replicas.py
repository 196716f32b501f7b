"""Two real `eplb serve` processes on one database (a SQLite file, then a throwaway PostgreSQL): a job submitted
to one is read and cancelled through the other; one window sent to both at once is processed once, both answered
alike; killing one replica mid-job leaves the job failed (not running) and the other replica serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import httpx

from eplb.io.windows import read_window
from tests.conftest import free_port, poll_job, wait_until_ready
from tests.db_fixtures import db_url_fixture, postgres_fixture  # noqa: F401
from tests.test_deployments import config, window

V3 = read_window(None).loads[:4]  # 4 real DeepSeek-V3 layers: a MILP on them runs for its whole budget
LEASE_S = 1.5


@contextmanager
def replica(db_url: str, **settings: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`eplb serve` on a free loopback port with the database at `db_url` and EPLB_<NAME> `settings`; stopped
    (or already killed) after."""
    port = free_port()
    env = {**os.environ, "EPLB_DATABASE_URL": db_url, "EPLB_JOB_LEASE_S": str(LEASE_S),
           "EPLB_SOLVER_WORKERS": "1", "EPLB_ASYNC_THRESHOLD_S": "5",
           **{f"EPLB_{k.upper()}": v for k, v in settings.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "eplb.cli", "serve", "--port", str(port), "--log-level",
                             "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, proc, timeout_s=120)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def kill_with_workers(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a replica, then its solver workers (each leads its own process group), as a crash would leave
    them: the workers are stopped so their solve does not keep the test's CPU."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    proc.kill()
    proc.wait()
    for pid in map(int, children):
        for kill in (os.killpg, os.kill):
            with suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def long_milp() -> dict[str, Any]:
    return {"model": "deepseek-v3", "hardware": "h100", "cluster": {"num_gpus": 16, "num_redundant": 16},
            "loads": V3.tolist(), "tokens_per_gpu": 4096, "solver": "milp", "time_limit_s": 60, "async": True}


def test_two_replicas_share_deployments_and_jobs(db_url: str) -> None:
    with ExitStack() as stack:
        (a, proc_a), (b, _) = stack.enter_context(replica(db_url)), stack.enter_context(replica(db_url))

        # one window sent to both replicas at once (two ranks of an engine): processed once, both answered alike
        body = config(trigger="threshold", threshold=1.1).model_dump(mode="json", exclude_none=True)
        assert httpx.put(f"{a}/deployments/shared", json=body, timeout=30).status_code == 201
        assert httpx.get(f"{b}/deployments/shared", timeout=30).json()["windows"] == 0
        assert httpx.post(f"{b}/deployments/shared/windows", json={"loads": window(0)}, timeout=60).json()[
            "action"] == "placed"
        answers: list[dict[str, Any]] = []
        barrier = threading.Barrier(2)

        def send(base: str) -> None:
            barrier.wait()
            r = httpx.post(f"{base}/deployments/shared/windows", json={"loads": window(1)}, timeout=120)
            answers.append(r.json())

        threads = [threading.Thread(target=send, args=(base,)) for base in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers[0]["action"] == "rebalanced" and answers[0] == answers[1], answers
        history = httpx.get(f"{a}/deployments/shared/history", timeout=30).json()["entries"]
        assert [(e["seq"], e["action"]) for e in history] == [(2, "rebalanced"), (1, "placed")]

        # a job submitted to A is read and cancelled through B
        submitted = httpx.post(f"{a}/placement", json=long_milp(), timeout=60)
        assert submitted.status_code == 202, submitted.text
        location = submitted.headers["location"]
        assert poll_job(b, location, ("running",))["status"] == "running"
        assert httpx.delete(f"{b}{location}", timeout=30).json()["status"] == "cancelled"
        time.sleep(2 * LEASE_S)  # A's next lease renewal sees the cancel and stops its solver
        assert httpx.get(f"{a}{location}", timeout=30).json()["status"] == "cancelled"
        assert httpx.get(f"{a}/readyz", timeout=30).json()["running"] == 0

        # A dies mid-job: the job ends failed (its lease lapses), B keeps serving
        submitted = httpx.post(f"{a}/placement", json=long_milp(), timeout=60)
        location = submitted.headers["location"]
        poll_job(b, location, ("running",))
        kill_with_workers(proc_a)
        failed = poll_job(b, location, ("failed", "done", "cancelled"), timeout_s=10 * LEASE_S + 10)
        assert failed["status"] == "failed" and "replica running this job stopped" in failed["error"]["detail"]
        listed = httpx.get(f"{b}/jobs", timeout=30).json()
        assert listed["active"] == 0 and all(j["status"] != "running" for j in listed["jobs"])
        one = httpx.get(f"{b}/jobs", params={"limit": 1}, timeout=30).json()
        assert one["jobs"] == listed["jobs"][:1] and one["kept"] == listed["kept"] == len(listed["jobs"])
        quick = httpx.post(f"{b}/deployments/shared/windows", json={"loads": window(2)}, timeout=60)
        assert quick.status_code == 200 and quick.json()["action"] == "rebalanced"

