"""A probe of the server's event loop for tests: how long /healthz takes while a slow request runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx


def healthz_while(base: str, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, float, float]:
    """Run `send` on a thread and poll `base`/healthz every 10 ms until it returns: (its response, the slowest
    /healthz in s, `send`'s time in s). Each /healthz must answer 200."""
    sent: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: sent.update(r=send()))
    worst = 0.0
    with httpx.Client(base_url=base, timeout=60) as client:  # one client: no per-request connection set-up
        start = time.perf_counter()
        sender.start()
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            worst = max(worst, time.perf_counter() - started)
            time.sleep(0.01)
        sender.join()
    return sent["r"], worst, time.perf_counter() - start


def loop_was_free(worst_s: float, elapsed_s: float) -> bool:
    """Whether the slowest /healthz (`worst_s`) shows an event loop that did not do the request's work: under
    0.25 s, or under a third of the request's time `elapsed_s` (a loaded machine slows both; work done in the
    loop holds /healthz for most of the request)."""
    return worst_s < max(0.25, elapsed_s / 3)
