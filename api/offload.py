"""Where a request's CPU work runs, never in the event loop: the fast lane (api/inline.py: a server thread, else an
idle solver process) for a small body, the parser process for a large one, the solver pool for solves; and their
failures as problems (503 busy, 500 for a dead worker). Every route that reads a body parses it here: `POST
/placement` and `/evaluate` through their worker entry points, every other route through `api.routing.Route`
(`parse_body`), so a 12 MB body never holds the loop that answers /healthz."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from api import convert
from api.inline import FastLane
from api.pool import QueueFull, SolvePool, WorkerDied
from api.problems import ProblemError
from api.settings import Settings


def busy(settings: Settings) -> ProblemError:
    return ProblemError(503, "Service busy", "every solver worker is busy and the wait queue is full",
                        headers={"Retry-After": str(settings.retry_after_s)})


async def in_pool(pool: SolvePool, settings: Settings, fn: Any, token: int | None = None,
                  on_start: Callable[[], None] | None = None, **kwargs: Any) -> Any:
    """Run a worker entry point of api/convert.py; pool failures become problems."""
    try:
        return await pool.submit(fn, pool.token() if token is None else token, on_start, **kwargs)
    except QueueFull:
        raise busy(settings) from None
    except WorkerDied as exc:
        raise ProblemError(500, "Solver failed", f"the solver process died: {exc}") from None
    except RuntimeError as exc:
        raise ProblemError(500, "Solver failed", str(exc)) from None


async def in_lane(lane: FastLane, settings: Settings, fn: Any, **kwargs: Any) -> convert.Answer:
    """Run a worker entry point of api/convert.py in the fast lane (a thread here, else a solver process);
    failures become problems."""
    try:
        answer: convert.Answer = await lane.submit(fn, **kwargs)
    except QueueFull:
        raise busy(settings) from None
    except WorkerDied as exc:
        raise ProblemError(500, "Solver failed", f"the solver process died: {exc}") from None
    except ProblemError:
        raise
    except RuntimeError as exc:  # the worker's report of an unexpected exception
        raise ProblemError(500, "Solver failed", str(exc)) from None
    except Exception as exc:  # a bug, not bad input (convert answers that with a problem)
        raise ProblemError(500, "Solver failed", f"{type(exc).__name__}: {exc}") from None
    return answer


def inline(settings: Settings, body: convert.Body) -> bool:
    """Whether the body is parsed (and, for an inline solver, solved) in the server's own threads."""
    return bool(settings.inline) and len(body.data) <= settings.inline_max_bytes


async def parse_body(request: Request, model: type[BaseModel], data: bytes) -> convert.Answer:
    """A JSON body validated into `model` (`convert.parse_body`: the model as `value`, or the problem's answer: 400
    not JSON, 422) where `POST /placement` parses its body: in the lane when it is small (`inline`), else in the
    parser process."""
    state = request.app.state
    settings: Settings = state.settings
    body = convert.Body(data, "json", request.url.path)
    if inline(settings, body):
        return await in_lane(state.inline, settings, convert.parse_body, model=model, body=body)
    answer: convert.Answer = await in_pool(state.parsers, settings, convert.parse_body, model=model, body=body)
    return answer
