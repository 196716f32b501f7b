"""Errors as RFC 9457 problem details (`application/problem+json`): the exception routes raise, the
response they become, the handlers that render every other error the same way, and the error responses
the OpenAPI schema documents."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from api.schemas import Problem
from eplb.errors import EplbError, FieldError, clip
from eplb.schemas import ARRAY_ERROR

PROBLEM = "application/problem+json"
INSTANCE_SHOWN = 200
"""The most characters of a request's path a problem echoes (every route's path with a name it can have fits)."""
MAX_ERRORS = 50
"""The most fields a 422's `errors` lists; one more entry says how many it left out (200,000 unknown keys were
200,000 errors, 12 MB)."""


class ProblemError(Exception):
    """Raised by routes and dependencies; rendered as problem details."""

    def __init__(
        self, status: int, title: str, detail: str, headers: dict[str, str] | None = None,
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail, self.headers, self.errors = status, title, detail, headers, errors

    def problem(self, instance: str | None = None) -> Problem:
        return Problem(title=self.title, status=self.status, detail=self.detail, instance=instance, errors=self.errors)


def problem_body(status: int, title: str, detail: str, instance: str | None = None,
                 errors: list[dict[str, Any]] | None = None) -> bytes:
    """The JSON bytes of one problem; `instance` (the request's path) clipped to `INSTANCE_SHOWN` characters."""
    shown = None if instance is None else clip(instance, INSTANCE_SHOWN)
    problem = Problem(title=title, status=status, detail=detail, instance=shown, errors=errors)
    return orjson.dumps(problem.model_dump(exclude_none=True))


def problem_response(
    status: int, title: str, detail: str, instance: str | None = None, headers: dict[str, str] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> Response:
    return Response(problem_body(status, title, detail, instance, errors), status_code=status, media_type=PROBLEM,
                    headers=headers)


def unauthorized() -> ProblemError:
    return ProblemError(401, "Unauthorized", "send 'Authorization: Bearer <key>' with the service's API key",
                        headers={"WWW-Authenticate": "Bearer"})


LINKS = ("must be a string: nvlink, nic, pcie, or GB/s per GPU per direction such as \"400\"; or a link within "
         "and one between nodes, e.g. nvlink+nic")
TYPE_MESSAGES = {"link": LINKS}
"""Messages for a value of the wrong type, by the field's name, where pydantic's ('Input should be a valid
string') does not say what the field takes."""
BOUNDS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"})
SCALARS = frozenset({"str", "int", "float", "bool"})


def is_union_tag(part: str) -> bool:
    """The union member pydantic tried: 'str', 'ModelSpec', 'constrained-float', 'list[..]', 'function-after[..]'."""
    return part in SCALARS or part.startswith("constrained-") or "[" in part or part[:1].isupper()


def field_errors(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """pydantic's errors as {field, message}: the dotted path into the body (never 'body' itself). Of a union
    (one number or one per GPU; a preset name or a spec object) only the member the value's shape chose
    speaks; a NaN or an infinity out of bounds must be a finite number; a numeric array's one error
    (`eplb.schemas.ARRAY_ERROR`) follows the field's path, naming its element: `loads[0][3] is null: ...`."""
    def tried_the_string_branch(err: Mapping[str, Any]) -> bool:  # "model": {...} also failed as a preset name
        return err.get("type") == "string_type" and any(is_union_tag(str(p)) for p in err.get("loc", ()))

    kept = [_array_error(e) for e in errors if not tried_the_string_branch(e)] or list(errors)
    out = []
    for err in _chosen_members(kept):
        loc = [_part(str(p)) for p in err.get("loc", ()) if p != "body" and not is_union_tag(str(p))]
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        value = err.get("input")
        field = ".".join(loc) or "body"
        if err.get("type") == ARRAY_ERROR:
            message = f"{field}{'' if message.startswith('[') else ' '}{message}"
        elif err.get("type") in BOUNDS and isinstance(value, float) and not math.isfinite(value):
            message = "Input should be a finite number"
        elif str(err.get("type", "")).endswith("_type") and loc and loc[-1] in TYPE_MESSAGES:
            message = TYPE_MESSAGES[loc[-1]]
        out.append({"field": field, "message": message})
    return out


def _part(name: str) -> str:
    """A key of the body as an error's field names it: clipped, with its length, past 40 characters (an unknown key
    of 1 MB came back twice)."""
    return name if len(name) <= 40 else f"{clip(name)} ({len(name):,} characters)"


def _array_error(err: Mapping[str, Any]) -> Mapping[str, Any]:
    """A numeric array's one error (`eplb.schemas.ARRAY_ERROR`) with its message: which element, what it is, what
    the array holds (`_ArrayCheck.explain`, run on the refused value only); for a value that is no list at all,
    pydantic's own list_type error (so a union's members are weighed as for any other value)."""
    if err.get("type") != ARRAY_ERROR:
        return err
    if not isinstance(err.get("input"), list):
        return {**err, "type": "list_type", "msg": "Input should be a valid array"}
    why = err["ctx"]["check"].explain(err["input"])
    return {**err, "msg": why} if why is not None else err


def _chosen_members(errors: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Errors of a union's members: a member whose type the value is not (a number given where the other member
    takes a list) is left out when another member says what is wrong inside it; when every member refused the
    value's type, one error says what the field takes ('Input should be a valid number or a valid array')."""
    def split(err: Mapping[str, Any]) -> tuple[tuple[Any, ...], Any, bool] | None:
        loc = tuple(err.get("loc", ()))
        at = next((i for i, p in enumerate(loc) if is_union_tag(str(p))), None)
        if at is None:
            return None
        mismatch = at == len(loc) - 1 and str(err.get("type", "")).endswith("_type")
        return loc[:at], loc[at], mismatch

    groups: dict[tuple[Any, ...], list[tuple[Mapping[str, Any], Any, bool]]] = {}
    for err in errors:
        part = split(err)
        if part is not None:
            groups.setdefault(part[0], []).append((err, part[1], part[2]))
    drop: set[int] = set()
    merged: dict[int, Mapping[str, Any]] = {}
    for members in groups.values():
        if len({tag for _, tag, _ in members}) < 2:
            continue
        mismatched = [err for err, _, mismatch in members if mismatch]
        if len(mismatched) < len(members):
            drop.update(id(err) for err in mismatched)
        else:
            wanted = [str(e.get("msg", "")).removeprefix("Input should be ") for e in mismatched]
            merged[id(mismatched[0])] = {**mismatched[0], "msg": "Input should be " + " or ".join(wanted)}
            drop.update(id(err) for err in mismatched[1:])
    return [merged.get(id(e), e) for e in errors if id(e) not in drop]


def not_json(reason: str) -> ProblemError:
    """The 400 for a body that is not JSON, one text whichever route read it (every body is parsed by the worker
    side, `api.convert`); reason: the parser's ('EOF while parsing a list at line 1 column 17')."""
    return ProblemError(400, "Body is not JSON", f"the body is not valid JSON: {reason.removeprefix('Invalid JSON: ')}")


def invalid(errors: list[dict[str, str]]) -> ProblemError:
    """The 422 of field errors; the detail lists the first five, 'field: message', or the message alone where it
    names its field itself ('loads[0][3] is null: ...', as `eplb.errors.FieldError` has it); `errors` the first
    `MAX_ERRORS`, then how many more."""
    detail = "; ".join(e["message"] if e["message"].startswith((e["field"] + "[", e["field"] + " "))
                       else f"{e['field']}: {e['message']}" for e in errors[:5])
    if len(errors) > MAX_ERRORS:
        more = {"field": "body", "message": f"and {len(errors) - MAX_ERRORS:,} more errors (the first {MAX_ERRORS} "
                "are listed)"}
        errors = [*errors[:MAX_ERRORS], more]
    return ProblemError(422, "Invalid request", detail, errors=errors)


def install_handlers(app: FastAPI) -> None:
    """Render ProblemError, FastAPI's validation errors, HTTP errors and EplbError as problem details."""

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> Response:
        return problem_response(exc.status, exc.title, exc.detail, request.url.path, exc.headers, exc.errors)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        """A path or query parameter FastAPI refused (`path.name`, `query.limit`, ...): no body reaches FastAPI's
        validation, `api.routing.Route` parses and validates every body itself (a bad one is `not_json`'s 400)."""
        error = invalid(field_errors(exc.errors()))
        return problem_response(422, error.title, error.detail, request.url.path, errors=error.errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Allow: every route's methods on this path, not just the first route's
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        return problem_response(exc.status_code, str(exc.detail), str(exc.detail), request.url.path, headers)

    @app.exception_handler(EplbError)
    async def _eplb(request: Request, exc: EplbError) -> Response:
        problem = field_problem(exc)
        return problem_response(problem.status, problem.title, problem.detail, request.url.path,
                                errors=problem.errors)


def field_problem(exc: EplbError) -> ProblemError:
    """An EplbError as the 422 problem: its text is the detail; a `FieldError`'s fields, each with its message,
    are the `errors` (the one place either becomes a problem: the handler above, and the worker side,
    api/convert.py, which answers without the app)."""
    errors = None
    if isinstance(exc, FieldError):
        errors = [{"field": field, "message": exc.message} for field in exc.fields]
    return ProblemError(422, "Invalid request", str(exc), errors=errors)


def allowed_methods(request: Request) -> list[str]:
    """The methods some route answers on the request's path (each method tried against the app's routes; HEAD
    wherever GET is, `api.middleware.Gate` answers it)."""
    allowed = []
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return [*allowed[:1], "HEAD", *allowed[1:]] if "GET" in allowed else allowed


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses (rendered as problem+json by app.openapi)."""
    return {status: {"model": Problem, "description": ERRORS[status]} for status in statuses}


ERRORS = {
    400: "the body is not valid JSON (or not a valid .npy array)",
    401: "missing or wrong API key",
    404: "no such resource",
    409: "a write lost to concurrent writes of the same deployment every attempt it made; send it again",
    413: "request body too large",
    415: "unsupported Content-Type: send application/json (or application/x-npy loads)",
    422: "invalid input; `errors` names the fields",
    500: "the solver failed",
    503: "every solver is busy and the queue is full, or too many jobs; retry after Retry-After",
}
