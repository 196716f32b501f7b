"""The one retry rule of the service's callers: the engine plug-ins (`eplb.integrations.core.Service`) and the Python
client (`eplb.client`). Which failed attempts are sent again, how often, how far apart, and how one timeout is shared
by all the attempts of a call; and how each attempt's outcome is said.

Sans I/O: `Attempts` says how long each attempt may wait for an answer and, after it, whether to send the same request
again and after what pause (the backoff, or longer when the answer's Retry-After asks for it and the timeout holds
it). `send` (sync) and `send_async` (asyncio) make the attempts with the caller's request function; each returns the
`Attempts`, whose `final` is the last attempt's answer or exception, for the caller to read in its own terms (a
plug-in's `Failure`, the client's exceptions).

Light: httpx and the standard library only (the plug-ins import it in the engine's process).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from itertools import groupby

import httpx

RETRIES = 2
"""Times a call to the service is sent again, the same request, and only for what another attempt can mend
(`mendable`): `RETRY_STATUSES` (a proxy or a service that is restarting or busy), a connection refused or reset before
an answer, and no answer in time while the call's timeout has time left. A 500 (a solve that crashed, a solver worker
that died) or a 4xx is not sent again: it would run again (for a plug-in, under the deployment's lock, for every
rank). Safe for the requests sent again (`Attempts.idempotent`): reads, PUT of a config, a solve or an evaluation (the
same answer), and a deployment's window: the service answers the same window and map once, then with that answer (its
window key), so a retry gets the first attempt's answer when that one was processed. A request that is not safe to
repeat (a job submitted, an applied placement recorded, a deployment deleted) is sent again only when it never left:
a connection refused (`httpx.ConnectError`, `httpx.ConnectTimeout`). All attempts share the call's timeout: each but
the last waits for the time left less `reserve_s` (the first, most of it), so the call ends no later than one attempt
did, and a solve that takes longer than the first attempt's wait is waited for once, not again and again."""
RETRY_STATUSES = frozenset({429, 502, 503, 504})
"""Error statuses sent again: too many requests (a rate limit in front of the service), bad gateway, service
unavailable (the service's 503: every solver busy), gateway timeout."""
BACKOFF_S = (0.1, 0.3)
"""Seconds between attempts (before the second, the third), or the answer's Retry-After when it asks for longer (the
service's 503 asks for `EPLB_RETRY_AFTER_S`, 5 s by default); an attempt that would have less than `MIN_ATTEMPT_S`
of the timeout left after the pause is not made, and nothing is slept for it: a Retry-After past the timeout ends
the call with that answer at once (`Attempts.unsent`)."""
MIN_ATTEMPT_S = 0.05
RESERVE_S = 1.0
"""Seconds of a call's timeout an attempt that may be followed by another leaves for it; at most a quarter of the
timeout (`reserve_s`)."""

Result = httpx.Response | Exception
"""What one attempt got: the service's answer, or the httpx exception (`httpx.HTTPError`, `httpx.InvalidURL`)."""


def reserve_s(timeout_s: float) -> float:
    """Seconds of the timeout kept back from an attempt for one retry: `RESERVE_S`, at most a quarter of it."""
    return min(RESERVE_S, timeout_s / 4)


def retry_after_s(result: Result) -> float | None:
    """Seconds an answer asks its caller to wait before sending the request again: its Retry-After, delay-seconds or
    an HTTP-date (RFC 9110, 10.2.3; a date past is 0); None: no answer, no Retry-After, or one that does not read."""
    if not isinstance(result, httpx.Response):
        return None
    value = result.headers.get("retry-after", "").strip()
    if value.isascii() and value.isdigit():
        return float(value)  # 10**400 digits: inf, which no timeout holds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    seconds = when.timestamp() - time.time()  # a date without a zone is read as UTC, as HTTP-dates are
    return max(0.0, seconds) if math.isfinite(seconds) else None


def tls_failed(result: Result) -> ssl.SSLError | None:
    """The TLS error behind a failed connection (an https:// URL to a plain-HTTP service: WRONG_VERSION_NUMBER),
    else None: no attempt mends it."""
    cause = result.__cause__ or result.__context__ if isinstance(result, Exception) else None
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    return cause


def failure(exc: Exception) -> str:
    """Why a request got no answer, in one line: the exception's text, and for https:// to a plain-HTTP service
    (`eplb serve`) what to give instead."""
    text = str(exc).strip().rstrip(".") or type(exc).__name__
    tls = tls_failed(exc)
    if tls is not None and "WRONG_VERSION_NUMBER" in str(tls):
        text += "; eplb serve speaks plain HTTP: give the URL as http://, or put a TLS proxy in front"
    return text


def mendable(result: Result, idempotent: bool = True) -> bool:
    """Whether another attempt of the same request can mend what this one got (`RETRIES` says what and why): for a
    request safe to repeat, a `RETRY_STATUSES` answer, no answer in time, a connection refused or reset before an
    answer; for any other, a connection refused (the request never left). A TLS handshake that failed is never
    mended."""
    if tls_failed(result) is not None:
        return False
    if not idempotent:
        return isinstance(result, httpx.ConnectError | httpx.ConnectTimeout)
    if isinstance(result, httpx.Response):
        return result.status_code in RETRY_STATUSES
    return isinstance(result, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError)


class Attempts:
    """The attempts of one call under the rule: `wait_s()` before each, `after(result, waited)` once it is done.
    `final` is the last attempt's result; `failed` holds every mendable failure, with the seconds it waited, in
    order (the last one too when no attempt was left for it); `asked`, when the final answer was not sent again
    because its Retry-After passed the timeout: (seconds asked, seconds the timeout had left)."""

    def __init__(self, timeout_s: float, idempotent: bool = True) -> None:
        self.timeout_s, self.idempotent = timeout_s, idempotent
        self.deadline = time.monotonic() + timeout_s
        self.made = 0
        self.final: Result | None = None
        self.failed: list[tuple[Result, float]] = []
        self.asked: tuple[float, float] | None = None

    def wait_s(self) -> float:
        """Seconds the next attempt may wait for its answer: the time left, less `reserve_s` when another attempt
        may follow (all of it when less than `MIN_ATTEMPT_S` would be left)."""
        left = self.deadline - time.monotonic()
        wait = left - reserve_s(self.timeout_s) if self.made < RETRIES else left
        return wait if wait >= MIN_ATTEMPT_S else left

    def after(self, result: Result, waited: float) -> float | None:
        """Record an attempt's result; the seconds to pause before sending the request again (the backoff, or the
        answer's Retry-After when longer), or None: `result` is the call's (not mendable, no attempt left, or too
        little time left after the pause: then nothing is slept)."""
        attempt, self.made, self.final = self.made, self.made + 1, result
        if not mendable(result, self.idempotent):
            return None
        self.failed.append((result, waited))
        if attempt >= RETRIES:
            return None
        asked = retry_after_s(result)
        pause = BACKOFF_S[attempt] if asked is None else max(BACKOFF_S[attempt], asked)
        left = self.deadline - time.monotonic()
        if left - pause < MIN_ATTEMPT_S:
            if asked is not None and asked == pause:
                self.asked = (asked, max(0.0, left))
            return None
        return pause

    def unsent(self) -> str:
        """Why the final answer was not sent again, when its Retry-After passed the timeout: 'Retry-After 5 s: more
        than the 2.9 s left of the call's 3 s timeout, not sent again'; else ''."""
        if self.asked is None:
            return ""
        asked, left = self.asked
        shown = f"{seconds(asked)} s" if math.isfinite(asked) else "beyond any timeout"
        return (f"Retry-After {shown}: more than the {seconds(left)} s left of the call's {seconds(self.timeout_s)} s "
                "timeout, not sent again")

    def history(self) -> str:
        """Every mendable failure said (`said`), consecutive equal ones once with their count: 'answered 503: busy
        (2 times), then no answer within 0.9 s'."""
        return _history(self.failed)

    def earlier(self) -> str:
        """The failures before the final attempt, said as `history` says them; '' when the first attempt was it."""
        final_failed = bool(self.failed) and self.failed[-1][0] is self.final
        return _history(self.failed[:-1] if final_failed else self.failed)


def send(request: Callable[[float], httpx.Response], timeout_s: float, idempotent: bool = True) -> Attempts:
    """Make the attempts of one call: `request(wait_s)` sends it once, waiting at most `wait_s` seconds for the
    answer; sent again as `Attempts.after` says. Returns the attempts (`final`: the answer or the exception)."""
    attempts = Attempts(timeout_s, idempotent)
    while True:
        wait = attempts.wait_s()
        try:
            result: Result = request(wait)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL ('http://[::1') is no HTTPError
            result = exc
        pause = attempts.after(result, wait)
        if pause is None:
            return attempts
        time.sleep(pause)


async def send_async(request: Callable[[float], Awaitable[httpx.Response]], timeout_s: float,
                     idempotent: bool = True) -> Attempts:
    """`send` for an asyncio caller: `await request(wait_s)`, the pauses slept with asyncio."""
    attempts = Attempts(timeout_s, idempotent)
    while True:
        wait = attempts.wait_s()
        try:
            result: Result = await request(wait)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            result = exc
        pause = attempts.after(result, wait)
        if pause is None:
            return attempts
        await asyncio.sleep(pause)


def _history(failed: list[tuple[Result, float]]) -> str:
    return ", then ".join(runs([said(result, waited) for result, waited in failed]))


def said(result: Result, waited: float) -> str:
    """One attempt's outcome in a few words: 'no answer within 4 s', 'unreachable (ConnectError: ...)', 'answered
    503: every solver worker is busy ...'."""
    if isinstance(result, httpx.TimeoutException):
        return f"no answer within {seconds(waited)} s"
    if isinstance(result, Exception):
        return f"unreachable ({type(result).__name__}: {failure(result)})"
    return f"answered {result.status_code}: {detail(result)}"


def detail(response: httpx.Response) -> str:
    """An error answer's detail (a problem's `detail`, else its JSON or text), at most 200 characters."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    return str(body.get("detail", body))[:200] if isinstance(body, dict) else str(body)[:200]


def runs(items: list[str]) -> list[str]:
    """Consecutive equal items once each, with how many times: ['a', 'a', 'b'] as ['a (2 times)', 'b']."""
    counted = [(item, len(list(group))) for item, group in groupby(items)]
    return [f"{item} ({count} times)" if count > 1 else item for item, count in counted]


def seconds(value: float) -> str:
    """4.0 as '4', 0.8997 as '0.9', 1.6667 as '1.67', 0.001 as '0.001' (not '0')."""
    if 0 < abs(value) < 0.01:
        return f"{value:.2g}"
    return f"{value:.2f}".rstrip("0").rstrip(".")
