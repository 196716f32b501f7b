"""A real HTTP proxy on a loopback port that fails the requests a script names: what the plug-ins' and the client's
retries (eplb.retry) are tested through, in front of a real `eplb serve`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

FORWARDED_HEADERS = ("content-type", "authorization")


def window_post(method: str, path: str) -> bool:
    """The requests a script counts by default: the POSTs of a deployment's windows."""
    return method == "POST" and path.endswith("/windows")


@contextmanager
def proxy(base: str, script: dict[int, int | str], counted: Callable[[str, str], bool] = window_post,
          retry_after: str | None = None) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """A real HTTP proxy on a loopback port in front of the service at `base`. Every request is forwarded (with its
    content type and Authorization) and its answer sent back, except the `counted(method, path)` requests (default:
    window POSTs) `script` names by number (1: the first counted request through the proxy, 2: the next, ...): a
    status is answered by the proxy itself; "drop" closes the connection without an answer (a reset); "late" is
    forwarded and processed, but its answer held until the next counted request arrives (its client has given up on
    it); "silent" gets no answer until the proxy closes. A status the proxy answers carries `Retry-After:
    retry_after` when given; a forwarded answer keeps the service's. Yields its URL and its log of counted
    requests in order: (number, what it did: "forwarded", the status, "drop", "late" or "silent")."""
    log: list[tuple[int, str]] = []
    changed = threading.Condition()  # a counted request logged, or the proxy closing
    closing: list[bool] = []
    upstream = httpx.Client(base_url=base, timeout=60)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            action: int | str | None = None
            if counted(self.command, self.path):
                with changed:
                    n = len(log) + 1
                    action = script.get(n)
                    log.append((n, "forwarded" if action is None else str(action)))
                    changed.notify_all()
            if action in ("drop", "silent"):
                with changed:  # "silent": until the proxy closes (60 s at most: a hang guard)
                    changed.wait_for(lambda: action == "drop" or bool(closing), timeout=60)
                self.close_connection = True
                return
            if isinstance(action, int):
                self.reply(action, json.dumps({"detail": f"the proxy's {action}"}).encode(),
                           retry_after=retry_after)
                return
            headers = {name: self.headers[name] for name in FORWARDED_HEADERS if self.headers.get(name)}
            answer = upstream.request(self.command, self.path, content=body, headers=headers)
            if action == "late":
                with changed:
                    changed.wait_for(lambda: len(log) > n or bool(closing), timeout=60)
            self.reply(answer.status_code, answer.content, answer.headers.get("content-type", "application/json"),
                       answer.headers.get("retry-after"))

        def reply(self, status: int, content: bytes, kind: str = "application/json",
                  retry_after: str | None = None) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)
            except OSError:  # the client gave up on this attempt
                pass

        do_GET = do_POST = do_PUT = do_DELETE = _forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        with changed:
            closing.append(True)
            changed.notify_all()
        server.shutdown()
        server.server_close()
        upstream.close()
