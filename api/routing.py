"""How every route reads a request: the route class of every router (`Route`) and the body checks routes share.

- Content-Type: JSON (`application/json`, any `+json` type, or none) wherever a route takes a body, and the loads as
  a .npy array (`application/x-npy`) where `POST /placement` and `/evaluate` take them; any other type is one 415
  naming it (`unsupported`), whichever route refused it.
- JSON bodies are parsed and validated as `POST /placement` parses its own, off the event loop (`api.offload`: the
  fast lane, or the parser process for a large body) by one parser, pydantic's: a body that is not JSON (an empty
  one too), or nests too deep, is one 400 (`api.problems.not_json`), an invalid one the same 422, whichever route
  read it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from api import offload
from api.problems import PROBLEM, ProblemError

JSON = "application/json"
NPY = "application/x-npy"


def media_type(request: Request) -> str:
    """The request's Content-Type, lower case, without parameters ('' when it has none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def is_json(content_type: str) -> bool:
    """Whether a body of this media type (`media_type`) is read as JSON: application/json, any +json type, or none."""
    return content_type in (JSON, "") or content_type.endswith("+json")


def unsupported(content_type: str, binary: str | None = None) -> ProblemError:
    """The 415 for a body of `content_type` (binary: the other type the route takes, `NPY` for the loads)."""
    wanted = JSON if binary is None else f"{JSON} (or the loads as {binary})"
    return ProblemError(415, "Unsupported Media Type", f"send the request as {wanted}, not {content_type}")


class _ParsedRequest(Request):
    """A request whose JSON body `Route` has parsed: FastAPI reads it from here instead of parsing it again."""

    parsed: Any = None

    async def json(self) -> Any:
        return self.parsed


class Route(APIRoute):
    """Every router's route class (`APIRouter(route_class=Route)`): a route with a JSON body (one pydantic model
    parameter) checks the Content-Type, then has the body parsed and validated where `POST /placement` parses its
    own (`api.offload.parse_body`: never in the event loop), its 400 or 422 answered as /placement answers them, and
    hands FastAPI the validated model (a route that reads its body itself, as /placement, checks it with
    `media_type` and `unsupported`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        model = self.body_field.field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{self.path}: a body here is one pydantic model, not {model}")

        async def json_body(request: Request) -> Response:
            content_type = media_type(request)
            if not is_json(content_type):
                raise unsupported(content_type)
            scope = request.scope
            if not content_type:  # FastAPI reads a body without a Content-Type as bytes: say it is JSON
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", JSON.encode())]}
            parsed = _ParsedRequest(scope, request.receive)
            answer = await offload.parse_body(parsed, model, await parsed.body())  # an empty body too: a 400
            if answer.status != 200:
                return Response(answer.body, status_code=answer.status, media_type=PROBLEM)
            parsed.parsed = answer.value  # FastAPI takes a model instance as it is (no second validation)
            return await handler(parsed)

        return json_body
