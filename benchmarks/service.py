"""Load test of the placement service: real `eplb serve` processes on loopback, greedy 58 x 256 requests (the
embedded DeepSeek-V3 window, EP32 with 288 slots), 1 and then 8 concurrent clients, each run bounded in time and
in requests. Prints latency p50/p90/p99 (ms) and throughput (req/s) per client count, for JSON and for .npy
loads, the server's CPU time per request (its process and its solver processes), and where one request's time
goes inside the server (parse + validate, solve, answer bytes).

Two servers run side by side and take turns, so both see the same machine: `inline` (the default fast lane: the
request is parsed, solved and serialized in a thread of the server process, or in one idle solver process when
that thread is busy) and `processes` (EPLB_INLINE_SOLVERS empty: a parser process, then a solver process, the
path every request took before). Bodies are encoded once, so the client's JSON encoding is not part of the
latency.

    python benchmarks/service.py [--seconds 10] [--max-requests 2000] [--workers 2] [--paths inline,processes]
                                 [--before DIR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from api import convert
from eplb.coactivation import summarize
from eplb.io.windows import read_window
from eplb.solve import solve
from eplb.synth import SynthConfig, synth_topk

FIELDS: dict[str, Any] = {"model": "deepseek-v3", "hardware": "h100", "cluster": {"num_gpus": 32, "slots_per_gpu": 9},
                          "tokens_per_gpu": 4096}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


DATA = tempfile.mkdtemp(prefix="eplb-bench-")  # the servers' databases, removed at exit
PATHS = {"inline": {}, "processes": {"EPLB_INLINE_SOLVERS": ""}}  # extra environment of each server


def start_server(workers: int, extra: dict[str, str], tree: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`eplb serve` with `extra` environment; from the checkout at `tree` (its own code first on the path)."""
    port = free_port()
    env = {**os.environ, "EPLB_SOLVER_WORKERS": str(workers), "EPLB_QUEUE_LIMIT": "64",
           "EPLB_DATA_DIR": tempfile.mkdtemp(prefix="eplb-bench-", dir=DATA), **extra}  # a database of its own
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, "-m", "eplb.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("eplb serve did not start")
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its live descendants, from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(c) for task in os.listdir(f"/proc/{pid}/task")
                    for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(c) for c in children)


def settle(pids: list[int], timeout_s: float = 120.0) -> None:
    """Wait until the servers and their solver processes are idle (a spawned worker imports for seconds after
    /readyz answers; it must not take CPU from the run being measured)."""
    deadline = time.monotonic() + timeout_s
    last = sum(cpu_seconds(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(cpu_seconds(pid) for pid in pids)
        if now - last < 0.05:
            return
        last = now


def run(base: str, clients: int, seconds: float, max_requests: int, send: dict[str, Any],
        pid: int = 0) -> dict[str, float]:
    """`clients` threads, each with its own connection, post until the time or the request budget is spent."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    budget = [max_requests]
    stop = 0.0

    def client() -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            while time.monotonic() < stop:
                with lock:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                started = time.perf_counter()
                r = http.post("/placement", **send)
                elapsed = time.perf_counter() - started
                with lock:
                    if r.status_code == 200:
                        latencies.append(elapsed)
                    else:
                        errors[0] += 1

    for _ in range(2):  # warm the workers (imports, first solve)
        httpx.post(f"{base}/placement", timeout=60, **send).raise_for_status()
    stop = time.monotonic() + seconds
    cpu = cpu_seconds(pid)
    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    cpu = cpu_seconds(pid) - cpu
    ms = np.array(latencies or [float("nan")]) * 1000
    return {"requests": len(latencies), "errors": errors[0], "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99)), "req_s": len(latencies) / wall,
            "cpu_ms": cpu * 1000 / max(1, len(latencies) + errors[0])}


def breakdown(loads: np.ndarray[Any, Any], repeats: int = 30) -> dict[str, float]:
    """Median ms of each stage of one request, in this process (what the fast lane, or the parser and a solver
    worker, do). answer: the bytes the service sends (api.convert.answer_json); answer_models: the same bytes
    through the pydantic answer models, as before. parse_json+summary / parse_json+summary_b64: parse_json of a
    body that also carries a co-activation summary of the window's shape (one synthetic step, 8 partners per
    expert; the body's loads are the step's own counts, which the summary must agree with), as its JSON object
    and as base64 of its .npz image."""
    body = convert.Body(json.dumps({**FIELDS, "loads": loads.tolist()}).encode(), "json", "/placement")
    buffer = io.BytesIO()
    np.save(buffer, loads)
    npy = convert.Body(buffer.getvalue(), "npy", "/placement", json.dumps(FIELDS))
    ids, _ = synth_topk(SynthConfig(steps=1, layers=loads.shape[0], experts=loads.shape[1], tokens=4096))
    summary = summarize(ids, loads.shape[1])
    counted = summary.loads.tolist()  # a summary must agree with its window (else a 422): the window it counted
    with_summary = {
        form: convert.Body(json.dumps({**FIELDS, "loads": counted, "coactivation": value}).encode(), "json",
                           "/placement")
        for form, value in (("parse_json+summary", summary.to_dict()),
                            ("parse_json+summary_b64", base64.b64encode(summary.to_bytes()).decode()))
    }  # fmt: skip
    image = summary.to_bytes()
    print(f"co-activation summary {loads.shape[0]} x {loads.shape[1]} x 8 partners: JSON "
          f"{len(json.dumps(summary.to_dict())):,} bytes, .npz image {len(image):,} (base64 "
          f"{len(base64.b64encode(image)):,})")
    stages: dict[str, list[float]] = {k: [] for k in ("parse_json", "parse_npy", "solve", "answer", "answer_models",
                                                      *with_summary)}  # fmt: skip
    for _ in range(repeats):
        for form, sent in with_summary.items():
            t0 = time.perf_counter()
            parsed = convert.parse_placement(sent, 30).job
            stages[form].append((time.perf_counter() - t0) * 1000)
            assert parsed is not None and parsed.coactivation is not None
        t0 = time.perf_counter()
        job = convert.parse_placement(body, 30).job
        t1 = time.perf_counter()
        convert.parse_placement(npy, 30)
        t2 = time.perf_counter()
        assert job is not None
        outcome = solve(job.loads, job.cluster, solver="greedy", cost=job.cost)
        t3 = time.perf_counter()
        convert.answer_json(outcome)
        t4 = time.perf_counter()
        orjson.dumps(outcome.to_model().to_json_dict())
        t5 = time.perf_counter()
        for key, a, b in (("parse_json", t0, t1), ("parse_npy", t1, t2), ("solve", t2, t3), ("answer", t3, t4),
                          ("answer_models", t4, t5)):
            stages[key].append((b - a) * 1000)
    return {k: statistics.median(v) for k, v in stages.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="time per run (default 10)")
    p.add_argument("--max-requests", type=int, default=2000, help="requests per run at most (default 2000)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="solver processes (default: CPUs)")
    p.add_argument("--paths", default="inline,processes",
                   help=f"servers to measure, taking turns (default inline,processes; of {', '.join(PATHS)})")
    p.add_argument("--before", metavar="DIR", help="also measure a server run from the checkout DIR (e.g. "
                   "`git worktree add --detach /tmp/before COMMIT`, kernels built there with "
                   "`python -c 'from setuptools import setup; setup()' build_ext --inplace`), as the path 'before'")
    args = p.parse_args()
    paths = [name.strip() for name in args.paths.split(",") if name.strip()]
    if not paths or any(name not in PATHS for name in paths):
        raise SystemExit(f"--paths: choose among {', '.join(PATHS)}")
    loads = read_window(None).loads
    print(f"window {loads.shape[0]} x {loads.shape[1]}, greedy, 32 GPUs x 9 slots; {os.cpu_count()} CPUs, "
          f"{args.workers} solver workers")
    print("in-process stages, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown(loads).items()))
    buffer = io.BytesIO()
    np.save(buffer, loads)
    kinds = {
        "json": {"content": orjson.dumps({**FIELDS, "loads": loads.tolist()}),
                 "headers": {"content-type": "application/json"}},
        "npy": {"content": buffer.getvalue(), "params": {"request": json.dumps(FIELDS)},
                "headers": {"content-type": "application/x-npy"}},
    }
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        if args.before:
            servers["before"] = start_server(args.workers, {}, os.path.abspath(args.before))
        for name in paths:
            servers[name] = start_server(args.workers, PATHS[name])
        settle([proc.pid for proc, _ in servers.values()])
        print(f"{'path':9} {'body':5} {'clients':>7} {'requests':>8} {'errors':>6} {'p50 ms':>7} {'p90 ms':>7} "
              f"{'p99 ms':>7} {'req/s':>6} {'cpu ms/req':>10}")
        for kind, send in kinds.items():
            for clients in (1, 8):
                for name, (proc, base) in servers.items():
                    r = run(base, clients, args.seconds, args.max_requests, send, proc.pid)
                    print(f"{name:9} {kind:5} {clients:>7} {r['requests']:>8} {r['errors']:>6} {r['p50']:>7.1f} "
                          f"{r['p90']:>7.1f} {r['p99']:>7.1f} {r['req_s']:>6.1f} {r['cpu_ms']:>10.2f}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=30)
        shutil.rmtree(DATA, ignore_errors=True)


if __name__ == "__main__":
    main()
