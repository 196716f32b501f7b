"""Python client of the placement service (`eplb serve`): `Client` (sync) and `AsyncClient` (asyncio), on httpx.

    from eplb.client import Client
    with Client("http://127.0.0.1:8000", api_key="...") as eplb:
        eplb.put_deployment("prod", {"model": "deepseek-v3", "hardware": "h100",
                                     "cluster": {"num_gpus": 32, "num_redundant": 32}})
        serving = None                                   # the placement the cluster serves, once one does
        for loads in windows:                            # loads: [layers, E] tokens (numpy or lists)
            answer = eplb.send_window("prod", loads, current_placement=serving)  # recorded first if not held
            if answer.result is not None and apply(answer.result.placement.phy2log):  # moved, or refused
                serving = answer.result.placement        # (refused: the next window says what still serves)

Answers are typed (pydantic models): `PlacementResponse` for placements, `Job` for background solves,
`DeploymentView` (a PUT's `DeploymentUpdate` adds `created` and `placement_dropped`), `WindowResult`, `HistoryPage`,
`HistoryEntry` for deployments. A problem answer (4xx/5xx)
raises `ServiceError` with the service's status, title and one-line detail; a service that cannot be reached
(refused, no such host, not an http(s) URL, timed out) raises `Unreachable`, and an answer that is not the
service's `NotTheService`; a request the client will not send (a deployment name the service cannot have, a
NaN or infinity, a value JSON cannot carry) raises `InvalidRequest` naming the field, and so does a deployment
config the service refuses (`InvalidConfig`, also a ServiceError: the service is the one judge of a config, so
a client older than the service sends what the service takes): each a one-line EplbError. Numpy arrays and
scalars are welcome at any depth of a request. What another attempt can mend (a 429, 502, 503 or 504, a
connection refused or reset, no answer in time) is sent again by the engine plug-ins' rule, `eplb.retry` (`Client`
says how).
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeAlias, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
from pydantic import BaseModel

from eplb import retry
from eplb.deployments import (
    DeploymentConfig,
    DeploymentUpdate,
    DeploymentView,
    HistoryEntry,
    HistoryPage,
    WindowResult,
)
from eplb.errors import EplbError, shown
from eplb.rules import api_key_refusal, name_refusal, timeout_refusal, url_refusal
from eplb.schemas import PlacementOut, PlacementResponse
from solvers.validation import whole_number

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary

T = TypeVar("T")
NO_ROUTE = "Not Found"
"""The detail of the service's 404 for a path it has no route for (the web framework's), not for a missing resource."""
Export = Literal["sglang", "trtllm", "vllm-ascend"]
Coactivation: TypeAlias = "CoactivationSummary | Mapping[str, Any] | str | bytes"
"""A window's co-activation summary: the summary, its JSON object (`to_dict`), its .npz image (`to_bytes`) or
base64 of that image."""


class ServiceError(EplbError):
    """The service answered with a problem (RFC 9457): status, title, detail (and field errors)."""

    def __init__(self, status: int, title: str, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status, self.title, self.detail, self.errors = status, title, detail, errors or []


class Unreachable(EplbError):
    """No answer from the service: "cannot reach URL: reason" (connection refused, unknown host, a URL httpx cannot
    use, timeout)."""


class NotTheService(EplbError):
    """An answer that is not the eplb service's (another server at that URL): what was asked and got."""


class InvalidRequest(EplbError):
    """A request the client refuses to send, naming what to fix: a deployment name the service cannot have, a
    NaN or infinity (JSON has neither), a value JSON cannot carry, a timeout that is no wait (`eplb.rules.
    timeout_refusal`), a call on a closed client; or a deployment config the service refused (`InvalidConfig`)."""


class InvalidConfig(InvalidRequest, ServiceError):
    """The service refused a deployment config (422): "deployment config: FIELD: message; ..." in one line, the
    fields those of the answer's `errors`; `status`, `detail` and `errors` as the service answered them."""

    def __init__(self, error: ServiceError) -> None:
        ServiceError.__init__(self, error.status, error.title, error.detail, error.errors)
        self.args = (f"deployment config: {_named(error)}",)


def _named(error: ServiceError) -> str:
    """A problem's field errors in one line, `field, field: message; ...` (errors with one message share it; at
    most 5), or its detail when it lists none. 'body' (the whole body: a rule across fields) names no field: its
    message does."""
    by_message: dict[str, list[str]] = {}
    for err in error.errors:
        if isinstance(err, Mapping) and err.get("message"):
            fields = by_message.setdefault(" ".join(str(err["message"]).split()), [])
            field = str(err.get("field") or "")
            if field and field != "body" and field not in fields:
                fields.append(field)
    parts = [f"{', '.join(fields)}: {message}" if fields and not _names(message, fields) else message
             for message, fields in by_message.items()]
    if not parts:
        return " ".join(error.detail.split()) or f"{error.status} {error.title}"
    more = len(parts) - 5
    return "; ".join(parts[:5]) + (f" (and {more} more)" if more > 0 else "")


def _names(message: str, fields: list[str]) -> bool:
    """Whether a message names its one field itself ('cluster.slots_per_gpu[1] is 0: ...'): said alone."""
    return len(fields) == 1 and message.startswith((fields[0] + "[", fields[0] + " "))


def _unreachable(url: str, exc: Exception) -> Unreachable:
    return Unreachable(f"cannot reach {url}: {retry.failure(exc)}")


def _read(url: str, call: _Call[T], attempts: retry.Attempts) -> T:
    """The call's answer after its attempts (`eplb.retry`): the last attempt's answer read (a ServiceError for a
    problem), or `Unreachable` for its exception; after attempts sent again, the message ends with what each got:
    '... (attempt 3, after unreachable (ConnectError: ...), then answered 502: ...)'."""
    final = attempts.final
    try:
        if isinstance(final, Exception):
            raise _unreachable(url, final)
        assert final is not None
        _check(final, call)
    except EplbError as error:
        earlier, unsent = attempts.earlier(), attempts.unsent()
        if earlier:
            error.args = (f"{error.args[0]} (attempt {attempts.made}, after {earlier})",)
        if unsent:
            error.args = (f"{error.args[0]} ({unsent})",)
        raise
    return _parse(url, call, final)


def _parse(url: str, call: _Call[T], response: httpx.Response) -> T:
    """The call's reading of the answer; NotTheService when the answer is no eplb answer (not JSON, not the model)."""
    try:
        return call.parse(response)
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError and JSON errors are ValueErrors
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise NotTheService(f"{call.method} {url}{call.path}: the answer (HTTP {response.status_code}, {kind}) is not "
                            "the eplb service's: is the URL that of `eplb serve`?") from None


class JobFailed(EplbError):
    """`wait` found the job failed or cancelled (`job` has its error)."""

    def __init__(self, job: Job) -> None:
        detail = job.error.get("detail", "") if job.error else ""
        super().__init__(f"job {job.id} {job.status}{': ' + detail if detail else ''}")
        self.job = job


class Job(BaseModel):
    """A background solve: queued, running, done (with `result`), failed (with `error`) or cancelled."""

    id: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    result: PlacementResponse | None = None
    error: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed", "cancelled")


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One HTTP exchange: what to send and how to read the answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: Any = None
    params: dict[str, Any] | None = None
    refusal: Callable[[ServiceError], EplbError] | None = None
    """What a 422 answer raises instead of ServiceError (a refused deployment config: InvalidConfig)."""
    idempotent: bool = True
    """Whether sending it again changes nothing more and gets the same answer (`eplb.retry.RETRIES`: what is sent
    again); False (a job submitted, an applied placement recorded, a deployment deleted): sent again only when it
    never left (a connection refused)."""


def _model(cls: type[BaseModel]) -> Callable[[httpx.Response], Any]:
    return lambda r: cls.model_validate(r.json())


def _known(cls: type[BaseModel], data: Any) -> Any:
    """`data` without the keys `cls` (and the models of its fields, at any depth) has no field for."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        field = cls.model_fields.get(key)
        if field is not None:
            sub = field.annotation
            out[key] = _known(sub, value) if isinstance(sub, type) and issubclass(sub, BaseModel) else value
    return out


def _view(data: Any) -> DeploymentView:
    """A deployment as the service answered it. Config fields this client does not know (a newer service's) are
    left out of the typed view, not refused: the service judged the config, the client only reads it."""
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        data = {**data, "config": _known(DeploymentConfig, data["config"])}
    return DeploymentView.model_validate(data)


def _update(response: httpx.Response) -> DeploymentUpdate:
    """A PUT's answer: the deployment (`_view`), `created` from the status (201; a service that does not say it in
    the body says it so) and `placement_dropped` as answered."""
    data = response.json()
    dropped = data.get("placement_dropped") if isinstance(data, dict) else None
    return DeploymentUpdate(**dict(_view(data)), created=response.status_code == 201, placement_dropped=dropped)


class _Bad(Exception):
    """Raised inside `_plain` at the offending value; each level adds its key on the way out."""

    def __init__(self, what: str) -> None:
        self.what, self.path = what, list[str]()


_SCALARS = frozenset({str, int, bool, type(None)})
_NUMBERS = frozenset({int, float, bool})
_FINITE = "the service takes finite numbers (JSON has no NaN or infinity)"


def _plain(value: Any) -> Any:
    """`value` as JSON-ready Python values: numpy arrays and scalars (and anything with `tolist`, a torch tensor)
    at any depth as lists and numbers, models as their JSON dump; _Bad at a NaN, an infinity or a value JSON has
    no form for."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    elif isinstance(value, np.ndarray):
        if value.dtype.kind == "f" and value.dtype.itemsize > 8:  # np.longdouble: its tolist() keeps numpy scalars
            with np.errstate(over="ignore"):  # beyond float64: inf, refused below
                value = value.astype(np.float64)
        if value.dtype.kind in "fc" and value.size and not np.isfinite(value).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
            bad = _Bad(f"is {value[where]}: {_FINITE}")
            bad.path = [f"[{i}]" for i in reversed(where)]
            raise bad
        if value.dtype.kind not in "biuf":  # strings and objects: checked element by element
            return _plain(value.tolist())
        return value.tolist()
    elif isinstance(value, np.generic) or (hasattr(value, "tolist") and not isinstance(value, (list, tuple))):
        value = float(value) if isinstance(value, np.floating) else value.tolist()  # np.longdouble too
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Bad(f"is {value}: {_FINITE}")
        return float(value)
    if isinstance(value, (str, int)):  # a subclass (an enum)
        return str.__str__(value) if isinstance(value, str) else int(value)
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            key = key.item() if isinstance(key, np.generic) else key
            if type(key) not in _SCALARS | _NUMBERS:
                raise _Bad(f"has the key {key!r}: JSON's keys are strings")
            try:
                out[key] = _plain(item)
            except _Bad as bad:
                bad.path.append(f".{key}")
                raise
        return out
    if isinstance(value, (list, tuple)):
        kinds = set(map(type, value))
        if kinds <= _SCALARS:  # the common case, a row of numbers: no call per element
            return list(value)
        if kinds <= _NUMBERS:
            try:
                if all(map(math.isfinite, value)):
                    return list(value)
            except OverflowError:  # an int too large for a float: JSON takes it, the loop below passes it
                pass
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_plain(item))
            except _Bad as bad:
                bad.path.append(f"[{i}]")
                raise
        return items
    name = kind.__name__
    raise _Bad(f"is {'an' if name[:1].lower() in 'aeiou' else 'a'} {name}: JSON has numbers, strings, lists and "
               "objects")


def _json(value: Any, name: str) -> Any:
    """`_plain(value)`; InvalidRequest naming the field (`name` and the path inside it) for what JSON cannot carry."""
    try:
        return _plain(value)
    except _Bad as bad:
        field = name + "".join(reversed(bad.path))
        raise InvalidRequest(f"{field.lstrip('.')} {bad.what}") from None


def _fields(request: Mapping[str, Any]) -> dict[str, Any]:
    """A request body given as keywords, JSON-ready (each field named in what InvalidRequest says); `coactivation`
    as `send_window` sends it (`_coactivation`: a CoactivationSummary too)."""
    return {key: _coactivation(value) if key == "coactivation" and value is not None else _json(value, key)
            for key, value in request.items()}


def _segment(name: str) -> str:
    """A deployment name as one URL path segment. A name the service cannot have is InvalidRequest here: no such
    deployment can exist, and a '/' or '?' in it would reach another route or deployment."""
    if not isinstance(name, str):
        kind = type(name).__name__
        raise InvalidRequest(f"deployment name {name!r}: a string, not {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    refused = name_refusal(name)
    if refused is not None:
        raise InvalidRequest(refused)
    return quote(name, safe="")


def _job_segment(job_id: str) -> str:
    """A job id as one URL path segment (the service's ids are hex). InvalidRequest for '', '.', '..' and an id with a
    '/' (the service decodes %2F: '../x' or 'ID/x' reached no route, '404 Not Found: Not Found')."""
    if not isinstance(job_id, str) or job_id in ("", ".", "..") or "/" in job_id:
        raise InvalidRequest(f"job id {job_id!r}: the id a submitted job answered (Job.id)")
    return quote(job_id, safe="")


def _layer_ids(layer_ids: str | Iterable[int]) -> str:
    """`layer_ids` as GET /deployments/{name}?format=... takes it: a string as given ("3-60", "0,1,5-7"; the
    service judges it), or ints, in their order, with runs written as ranges (3..60 is "3-60")."""
    if isinstance(layer_ids, str):
        return layer_ids
    try:
        ids = list(layer_ids)
    except TypeError:
        raise InvalidRequest(f"layer_ids: a string such as 3-60 or 0,1,5-7, or a sequence of ints, not a "
                             f"{type(layer_ids).__name__}") from None
    bad = [v for v in ids if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0]
    if bad or not ids:
        what = f"{bad[0]!r} is no model layer" if bad else "none given"
        raise InvalidRequest(f"layer_ids: {what}: give one model layer (an int >= 0) per placement layer, or a "
                             "string such as 3-60 or 0,1,5-7")
    runs: list[list[int]] = []
    for v in map(int, ids):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _config(config: DeploymentConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A deployment config as PUT sends it. A dict is sent as given (JSON-ready): the service judges it, so a
    field a newer service takes is never refused here (its 422 is InvalidConfig); a DeploymentConfig sends only
    the fields set, so a newer client's defaults never reach an older service that does not know them."""
    if isinstance(config, DeploymentConfig):
        config = config.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    elif not isinstance(config, Mapping):
        raise InvalidRequest(f"deployment config: a DeploymentConfig or a dict, not a {type(config).__name__}")
    body: dict[str, Any] = _json(config, "config")
    return body


def _coactivation(summary: Coactivation) -> Any:
    """A window's co-activation summary as the service takes it: base64 of its .npz image (a CoactivationSummary,
    or that image as bytes), a base64 string as given, or its JSON object (`to_dict`)."""
    from eplb.coactivation import CoactivationSummary

    if isinstance(summary, CoactivationSummary):
        summary = summary.to_bytes()
    if isinstance(summary, (bytes, bytearray, memoryview)):
        return base64.b64encode(summary).decode("ascii")
    if not isinstance(summary, (str, Mapping)):
        raise InvalidRequest(f"coactivation: a CoactivationSummary, its dict (to_dict), its .npz image (to_bytes) "
                             f"or base64 of it, not a {type(summary).__name__}")
    return _json(summary, "coactivation")


def _placement_or_job(r: httpx.Response) -> PlacementResponse | Job:
    return Job.model_validate(r.json()) if r.status_code == 202 else PlacementResponse.model_validate(r.json())


def _check(response: httpx.Response, call: _Call[Any]) -> None:
    if response.status_code < 400:
        return
    try:
        _problem(response)
    except ServiceError as error:
        if call.refusal is not None and error.status == 422:
            raise call.refusal(error) from None
        raise


def _problem(response: httpx.Response) -> None:
    """ServiceError of a problem answer (or of an answer that is no problem details)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):  # not problem details: a proxy's plain text, or another server at that URL
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        text = " ".join(response.text.split())[:200]
        detail = text if kind == "text/plain" and text else f"a {kind} answer, no problem details: is the URL that " \
            "of `eplb serve`?"
        raise ServiceError(response.status_code, response.reason_phrase, detail)
    detail = str(body.get("detail", ""))
    if response.status_code == 404 and detail == NO_ROUTE:  # the framework's: no route for the path, no resource
        path = str(body.get("instance") or response.request.url.path)
        base = str(response.request.url.copy_with(path="/", query=None, fragment=None)).rstrip("/")
        detail = (f"no route {path} on the service at {base}: is the client's base URL that of `eplb serve` "
                  f"(http://HOST:PORT, with no path unless a proxy serves it under one)?")
    elif response.status_code == 401:  # which key the service refused: the caller's api_key, or none
        sent = "authorization" in response.request.headers
        detail += " (the client's api_key is not the service's key)" if sent else \
            " (the client has no api_key: Client(url, api_key=KEY), KEY the service's EPLB_API_KEY)"
    raise ServiceError(response.status_code, str(body.get("title", response.reason_phrase)), detail,
                       body.get("errors"))


class _Api:
    """The calls, written once for both clients."""

    @staticmethod
    def placement(request: dict[str, Any], run_async: bool) -> _Call[PlacementResponse | Job]:
        body = _fields(request)
        if run_async:  # a job each time it is sent
            body["async"] = True
        return _Call("POST", "/placement", _placement_or_job, json=body, idempotent=not run_async)

    @staticmethod
    def evaluate(request: dict[str, Any]) -> _Call[PlacementResponse]:
        return _Call("POST", "/evaluate", _model(PlacementResponse), json=_fields(request))

    @staticmethod
    def job(job_id: str) -> _Call[Job]:
        return _Call("GET", f"/jobs/{_job_segment(job_id)}", _model(Job))

    @staticmethod
    def cancel(job_id: str) -> _Call[Job]:
        return _Call("DELETE", f"/jobs/{_job_segment(job_id)}", _model(Job))

    @staticmethod
    def put_deployment(name: str, config: DeploymentConfig | dict[str, Any]) -> _Call[DeploymentUpdate]:
        path = f"/deployments/{_segment(name)}"
        return _Call("PUT", path, _update, json=_config(config), refusal=InvalidConfig)

    @staticmethod
    def deployment(name: str) -> _Call[DeploymentView]:
        return _Call("GET", f"/deployments/{_segment(name)}", lambda r: _view(r.json()))

    @staticmethod
    def deployments() -> _Call[list[DeploymentView]]:
        return _Call("GET", "/deployments",
                     lambda r: [_view(d) for d in r.json()["deployments"]])

    @staticmethod
    def export(name: str, format: Export, layer_ids: str | Iterable[int] | None) -> _Call[dict[str, Any]]:
        params = {"format": format} if layer_ids is None else {"format": format, "layer_ids": _layer_ids(layer_ids)}
        return _Call("GET", f"/deployments/{_segment(name)}", lambda r: dict(r.json()), params=params)

    @staticmethod
    def delete_deployment(name: str) -> _Call[None]:
        return _Call("DELETE", f"/deployments/{_segment(name)}", lambda r: None, idempotent=False)  # then a 404

    @staticmethod
    def send_window(name: str, loads: Any, force: bool, coactivation: Coactivation | None,
                    current_placement: PlacementOut | dict[str, Any] | None) -> _Call[WindowResult]:
        body = {"loads": _json(loads, "loads"), "force": force}
        if coactivation is not None:
            body["coactivation"] = _coactivation(coactivation)
        if current_placement is not None:
            body["current_placement"] = _placement_body(current_placement, "current_placement")
        return _Call("POST", f"/deployments/{_segment(name)}/windows", _model(WindowResult), json=body)

    @staticmethod
    def history(name: str, limit: int, before: int | None) -> _Call[HistoryPage]:
        params = {key: _whole(value, key) for key, value in (("limit", limit), ("before", before)) if value is not None}
        return _Call("GET", f"/deployments/{_segment(name)}/history", _model(HistoryPage), params=params)

    @staticmethod
    def applied(name: str, placement: PlacementOut | dict[str, Any]) -> _Call[HistoryEntry]:
        body = _placement_body(placement, "placement")
        return _Call("POST", f"/deployments/{_segment(name)}/placement", _model(HistoryEntry), json={"placement": body},
                     idempotent=False)  # sent again after a window moved the placement, it would undo that


def _whole(value: object, name: str) -> int:
    """`value` as an int when it is one (numpy's too: `whole_number`); InvalidRequest naming `name` otherwise (True
    was sent as 'true', 2.0 as '2.0', for the service to refuse)."""
    count = whole_number(value)
    if count is not None:
        return count
    raise InvalidRequest(f"{name} must be a whole number (an int), got {shown(value)}")


def _placement_body(placement: PlacementOut | dict[str, Any], name: str) -> dict[str, Any]:
    """A placement object as the service takes it: every field given but the absent ones (the service judges
    them); InvalidRequest naming `name` for anything else."""
    body = _json(placement, name)
    if not isinstance(body, dict):
        raise InvalidRequest(f"{name}: a placement object (PlacementOut or its dict), not a {type(placement).__name__}")
    return {k: v for k, v in body.items() if v is not None}


def _headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header; InvalidRequest, the key not shown, for a key no HTTP request can carry (httpx raised
    UnicodeEncodeError for a non-ASCII one and InvalidURL, reported as Unreachable, for a line break)."""
    if api_key is None:
        return {}
    if not isinstance(api_key, str):
        raise InvalidRequest(f"api_key: a string (the service's EPLB_API_KEY) or None, not a {type(api_key).__name__}")
    refused = api_key_refusal(api_key)
    if refused is not None:
        raise InvalidRequest(f"api_key (not shown) {refused}: give the service's EPLB_API_KEY"
                             + (", or None for a service that asks for none" if refused == "is blank" else ""))
    return {"Authorization": f"Bearer {api_key}"}


def _result(job: Job) -> PlacementResponse:
    if job.result is None:
        raise EplbError(f"job {job.id} is done but has no result")
    return job.result


def _deadline(timeout: float | None) -> float | None:
    """When `wait` gives up: None for no limit; InvalidRequest for a timeout that is no wait (`timeout_refusal`: a NaN
    waited forever, a string raised TypeError, -1 gave up at once saying 'still running after -1 s')."""
    if timeout is None:
        return None
    refused = timeout_refusal(timeout)
    if refused is not None:
        raise InvalidRequest(f"wait's timeout {refused} (or None: no limit)")
    return time.monotonic() + float(timeout)


def _backoff(delay: float) -> float:
    return min(delay * 1.5, 2.0)


_Http = TypeVar("_Http", httpx.Client, httpx.AsyncClient)


def _open(factory: Callable[..., _Http], base_url: str, api_key: str | None, timeout: float, transport: Any) -> _Http:
    """An httpx client (sync or async) for the service; a URL httpx cannot use is `Unreachable`, a timeout that is
    no wait InvalidRequest."""
    refused = timeout_refusal(timeout)
    if refused is not None:
        raise InvalidRequest(f"timeout {refused}")
    refused = url_refusal(base_url)
    if refused is not None:
        raise InvalidRequest(f"base_url {refused}")
    try:
        return factory(base_url=base_url, headers=_headers(api_key), timeout=float(timeout), transport=transport)
    except httpx.InvalidURL as exc:
        raise _unreachable(base_url, exc) from None


def _not_closed(http: httpx.Client | httpx.AsyncClient, kind: str) -> None:
    """InvalidRequest for a call on a closed client (httpx raised RuntimeError)."""
    if http.is_closed:
        raise InvalidRequest(f"this {kind} is closed (close(), or the end of its with block): open a new one")


class Client:
    """Synchronous client. base_url: e.g. http://127.0.0.1:8000 (no http(s) URL of a host: InvalidRequest);
    api_key: the service's EPLB_API_KEY;
    timeout: seconds one call waits, shared by its attempts (each attempt waits for the time left, less a reserve
    for the next; httpx applies it to connecting and to each read, so an answer that trickles in can take longer;
    a synchronous MILP answer takes its time budget);
    above 0, at most `eplb.rules.MAX_TIMEOUT_S` (a day), else InvalidRequest. A call after `close` is InvalidRequest.

    A call is sent again, the same request, by the rule the engine plug-ins follow (`eplb.retry`): up to
    `eplb.retry.RETRIES` more times, 0.1 s then 0.3 s apart (or after the answer's Retry-After when longer and
    `timeout` holds it; one it does not hold ends the call at once), for a 429, 502, 503 or 504, a connection refused
    or reset before an answer, or no answer in time while `timeout` has time left (each attempt that may be followed
    by another waits for the time left less `eplb.retry.reserve_s`); a call that is not safe to repeat (`submit`,
    `applied`, `delete_deployment`) only after a connection refused. A 500 or a 4xx is never sent again."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 timeout: float = 120.0, transport: httpx.BaseTransport | None = None) -> None:
        self._url = base_url.rstrip("/")
        self._http = _open(httpx.Client, base_url, api_key, timeout, transport)
        self._timeout = float(timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _do(self, call: _Call[T]) -> T:
        _not_closed(self._http, "Client")

        def attempt(wait: float) -> httpx.Response:
            return self._http.request(call.method, call.path, json=call.json, params=call.params, timeout=wait)

        return _read(self._url, call, retry.send(attempt, self._timeout, call.idempotent))

    # placement and jobs
    def placement(self, **request: Any) -> PlacementResponse:
        """POST /placement (the fields of the request body as keywords; numpy arrays welcome). An answer the
        service turns into a job (a long MILP) is waited for."""
        answer = self._do(_Api.placement(request, run_async=False))
        return _result(self.wait(answer.id)) if isinstance(answer, Job) else answer

    def submit(self, **request: Any) -> Job:
        """POST /placement as a background job; `wait` or `cancel` it."""
        answer = self._do(_Api.placement(request, run_async=True))
        if not isinstance(answer, Job):
            raise EplbError("the service answered at once instead of starting a job")
        return answer

    def evaluate(self, **request: Any) -> PlacementResponse:
        return self._do(_Api.evaluate(request))

    def job(self, job_id: str) -> Job:
        return self._do(_Api.job(job_id))

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Poll until the job is done (0.1 s, growing to 2 s between polls); JobFailed if it failed or was
        cancelled, TimeoutError after `timeout` seconds (None: no limit; else the rule of the client's own timeout,
        InvalidRequest for one that is no wait)."""
        deadline, delay = _deadline(timeout), 0.1
        while True:
            job = self.job(job_id)
            if job.finished:
                if job.status != "done":
                    raise JobFailed(job)
                return job
            if deadline is not None and time.monotonic() + delay > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout} s")
            time.sleep(delay)
            delay = _backoff(delay)

    def cancel(self, job_id: str) -> Job:
        return self._do(_Api.cancel(job_id))

    # deployments
    def put_deployment(self, name: str, config: DeploymentConfig | dict[str, Any]) -> DeploymentUpdate:
        """PUT /deployments/{name}: register or update; `created` (201) and `placement_dropped` say what it did."""
        return self._do(_Api.put_deployment(name, config))

    def deployment(self, name: str) -> DeploymentView:
        return self._do(_Api.deployment(name))

    def deployments(self) -> list[DeploymentView]:
        return self._do(_Api.deployments())

    def export(self, name: str, format: Export, layer_ids: str | Iterable[int] | None = None) -> dict[str, Any]:
        """The current placement in a serving system's format (sglang, trtllm, vllm-ascend). layer_ids (sglang
        and trtllm): the model layer of each placement layer, "3-60" or "0,1,5-7" or ints (default: the model
        preset's MoE layers when the placement has all of them, else 0..L-1); the service checks them."""
        return self._do(_Api.export(name, format, layer_ids))

    def delete_deployment(self, name: str) -> None:
        self._do(_Api.delete_deployment(name))

    def send_window(self, name: str, loads: Any, force: bool = False, *, coactivation: Coactivation | None = None,
                    current_placement: PlacementOut | dict[str, Any] | None = None) -> WindowResult:
        """Send a load window ([layers, E] tokens); the answer says placed/rebalanced (with the result and
        plan) or kept (and why). coactivation: the window's co-activation summary (`eplb.coactivation.
        CoactivationSummary`, sent as base64 of its .npz image; or its dict, or base64 of its image): the
        predictions count the GPUs a token reaches (`result.predicted.copies_per_token`), the time objective
        co-locates experts chosen together, and the history keeps it. The service stores a placement it answers
        as the deployment's serving one: current_placement, the placement the cluster serves (a PlacementOut or
        its dict), is recorded first when the deployment holds another (the plan refused or delayed; or after
        `Unreachable` for a timeout, when the service may have rebalanced all the same), so the window is judged
        against, and rebalanced from, what serves (`applied` says so between windows). The same window sent again
        (same loads, current_placement, force, summary) while nothing changed gets the same answer, nothing
        stored: a retry after `Unreachable` is safe, and so is every EP rank sending it."""
        return self._do(_Api.send_window(name, loads, force, coactivation, current_placement))

    def history(self, name: str, limit: int = 50, before: int | None = None) -> HistoryPage:
        return self._do(_Api.history(name, limit, before))

    def applied(self, name: str, placement: PlacementOut | dict[str, Any]) -> HistoryEntry:
        """Record the placement the cluster now serves: every field given is sent (a placement file's
        `layer_ids` too), and the service checks them. The placement already serving records nothing: the answer
        is the entry that made it serve (placed, rebalanced or applied)."""
        return self._do(_Api.applied(name, placement))


class AsyncClient:
    """The same calls as `Client`, awaitable, sent again by the same rule."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 timeout: float = 120.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._url = base_url.rstrip("/")
        self._http = _open(httpx.AsyncClient, base_url, api_key, timeout, transport)
        self._timeout = float(timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _do(self, call: _Call[T]) -> T:
        _not_closed(self._http, "AsyncClient")

        async def attempt(wait: float) -> httpx.Response:
            return await self._http.request(call.method, call.path, json=call.json, params=call.params, timeout=wait)

        return _read(self._url, call, await retry.send_async(attempt, self._timeout, call.idempotent))

    async def placement(self, **request: Any) -> PlacementResponse:
        answer = await self._do(_Api.placement(request, run_async=False))
        return _result(await self.wait(answer.id)) if isinstance(answer, Job) else answer

    async def submit(self, **request: Any) -> Job:
        answer = await self._do(_Api.placement(request, run_async=True))
        if not isinstance(answer, Job):
            raise EplbError("the service answered at once instead of starting a job")
        return answer

    async def evaluate(self, **request: Any) -> PlacementResponse:
        return await self._do(_Api.evaluate(request))

    async def job(self, job_id: str) -> Job:
        return await self._do(_Api.job(job_id))

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        deadline, delay = _deadline(timeout), 0.1
        while True:
            job = await self.job(job_id)
            if job.finished:
                if job.status != "done":
                    raise JobFailed(job)
                return job
            if deadline is not None and time.monotonic() + delay > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout} s")
            await asyncio.sleep(delay)
            delay = _backoff(delay)

    async def cancel(self, job_id: str) -> Job:
        return await self._do(_Api.cancel(job_id))

    async def put_deployment(self, name: str, config: DeploymentConfig | dict[str, Any]) -> DeploymentUpdate:
        """PUT /deployments/{name}: register or update; `created` (201) and `placement_dropped` say what it did."""
        return await self._do(_Api.put_deployment(name, config))

    async def deployment(self, name: str) -> DeploymentView:
        return await self._do(_Api.deployment(name))

    async def deployments(self) -> list[DeploymentView]:
        return await self._do(_Api.deployments())

    async def export(self, name: str, format: Export, layer_ids: str | Iterable[int] | None = None) -> dict[str, Any]:
        return await self._do(_Api.export(name, format, layer_ids))

    async def delete_deployment(self, name: str) -> None:
        await self._do(_Api.delete_deployment(name))

    async def send_window(self, name: str, loads: Any, force: bool = False, *,
                          coactivation: Coactivation | None = None,
                          current_placement: PlacementOut | dict[str, Any] | None = None) -> WindowResult:
        return await self._do(_Api.send_window(name, loads, force, coactivation, current_placement))

    async def history(self, name: str, limit: int = 50, before: int | None = None) -> HistoryPage:
        return await self._do(_Api.history(name, limit, before))

    async def applied(self, name: str, placement: PlacementOut | dict[str, Any]) -> HistoryEntry:
        return await self._do(_Api.applied(name, placement))
