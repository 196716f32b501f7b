"""The raw-ASGI gate in front of every route: it times and counts every answer (the 401s and 413s it gives
itself included), answers HEAD as the GET of its path without the body (RFC 9110: every GET route answers HEAD,
whatever methods it declares), checks the API key of a request that may carry a body before reading a byte of it,
and refuses bodies over the limit while they stream in."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import key_ok
from api.metrics import Metrics
from api.problems import problem_response, unauthorized
from api.settings import Settings

GUARDED = frozenset({"POST", "PUT", "PATCH", "DELETE"})  # methods that change state or carry a body


class Gate:
    """ASGI middleware: metrics, then the API key, then the body limit, then the app."""

    def __init__(self, app: ASGIApp, settings: Settings, metrics: Metrics,
                 openapi: Callable[[], dict[str, Any]]) -> None:
        self.app, self.settings, self.metrics, self.openapi = app, settings, metrics, openapi
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        method = scope["method"]
        if method == "HEAD":  # the GET, headers and all (its Content-Length too), without the body
            scope = {**scope, "method": "GET"}

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif method == "HEAD" and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted)
        finally:
            self.metrics.request(self._route(scope), method, status, time.perf_counter() - started)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in GUARDED:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization")
        if not key_ok(self.settings, None if authorization is None else authorization.decode("latin-1")):
            error = unauthorized()
            await problem_response(error.status, error.title, error.detail, scope["path"], error.headers)(
                scope, receive, send)
            return
        limit = self.settings.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem_response(
            413, "Request body too large",
            f"the body exceeds {self.settings.max_body_bytes} bytes (EPLB_MAX_BODY_BYTES)", scope["path"],
        )
        await response(scope, receive, send)

    def _route(self, scope: Scope) -> str:
        """The route's path template (the metrics label); for answers given before routing (401, 413), the
        documented path the request would have reached."""
        route = scope.get("route")
        if route is not None:
            return str(getattr(route, "path", "unmatched"))
        if self._templates is None:
            paths = self.openapi().get("paths", {})
            self._templates = [(compile_path(path)[0], path) for path in paths]
        return next((path for regex, path in self._templates if regex.match(scope["path"])), "unmatched")
