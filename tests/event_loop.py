"""A probe of the server's event loop for tests: how long /healthz takes while a slow request runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx


def healthz_while(base: str, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    """Run `send` on a thread and poll `base`/healthz every 10 ms until it returns: (its response, the slowest
    /healthz in s). Each /healthz must answer 200."""
    sent: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: sent.update(r=send()))
    worst = 0.0
    with httpx.Client(base_url=base, timeout=60) as client:  # one client: no per-request connection set-up
        sender.start()
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            worst = max(worst, time.perf_counter() - started)
            time.sleep(0.01)
        sender.join()
    return sent["r"], worst
