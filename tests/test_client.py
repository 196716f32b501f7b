"""eplb.client against a real `eplb serve` (its database a SQLite file in a temporary directory): typed
placements, jobs (submit, wait with backoff, cancel), deployments (windows with co-activation summaries, applied
placements), problems as ServiceError, refused configs as InvalidConfig; sync and async."""

from __future__ import annotations

import asyncio
import base64
import email.utils
import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import numpy as np
import pytest
from pydantic import BaseModel

from eplb import retry
from eplb.client import (
    AsyncClient,
    Client,
    Coactivation,
    InvalidConfig,
    InvalidRequest,
    Job,
    JobFailed,
    ServiceError,
    Unreachable,
)
from eplb.deployments import (
    ClusterShape,
    DeploymentConfig,
    DeploymentUpdate,
    DeploymentView,
    HistoryEntry,
    HistoryPage,
    WindowResult,
)
from eplb.schemas import PlacementResponse
from tests.cli_run import error_prefix
from tests.flaky_proxy import proxy
from tests.test_deployments import MODEL, config, window
from tests.test_replicas import V3, replica

KEY = "secret-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The service's URL and its database's."""
    db = f"sqlite:///{tmp_path_factory.mktemp('client') / 'eplb.db'}"
    with replica(db, api_key=KEY) as (url, _):
        yield url, db


@pytest.fixture(scope="module")
def base(served: tuple[str, str]) -> str:
    return served[0]


def request() -> dict[str, object]:
    return {"model": "deepseek-v3", "hardware": "h100", "cluster": {"num_gpus": 16, "num_redundant": 16},
            "loads": V3, "tokens_per_gpu": 4096}


def test_placement_jobs_and_errors(base: str) -> None:
    with Client(base, api_key=KEY) as eplb:
        answer = eplb.placement(**request())  # a numpy array as loads
        assert isinstance(answer, PlacementResponse) and answer.placement.num_gpus == 16
        lb_mean, baseline_lb_mean = answer.predicted.lb_mean, answer.predicted.baseline.lb_mean
        assert lb_mean is not None and baseline_lb_mean is not None and lb_mean < baseline_lb_mean
        job = eplb.submit(**request())
        assert job.status in ("queued", "running", "done")
        done = eplb.wait(job.id, timeout=120)
        assert done.status == "done" and done.result is not None
        assert done.result.placement.phy2log == answer.placement.phy2log  # greedy: the same answer
        long = eplb.submit(**request(), solver="milp", time_limit_s=60)
        assert eplb.cancel(long.id).status == "cancelled"
        with pytest.raises(JobFailed, match=f"job {long.id} cancelled"):
            eplb.wait(long.id)
        slow = eplb.submit(**request(), solver="milp", time_limit_s=60)
        with pytest.raises(TimeoutError, match=f"job {slow.id} still"):
            eplb.wait(slow.id, timeout=0.5)
        eplb.cancel(slow.id)
        judged = eplb.evaluate(model="deepseek-v3", hardware="h100", loads=V3, placement=answer.placement)
        assert judged.predicted.lb == answer.predicted.lb
        with pytest.raises(ServiceError) as missing:
            eplb.job("0" * 32)
        assert missing.value.status == 404 and "does not exist" in missing.value.detail
    with Client(base, api_key="wrong") as intruder, pytest.raises(ServiceError, match="401 Unauthorized"):
        intruder.put_deployment("x", config())


def test_a_401_says_whether_the_client_sent_a_key(base: str) -> None:
    """A 401 said only the service's words, 'send 'Authorization: Bearer <key>' with the service's API key', the same
    for a client without api_key and one with the wrong one; it says which now, in the client's terms."""
    refused = "401 Unauthorized: send 'Authorization: Bearer <key>' with the service's API key"
    for key, said in ((None, " (the client has no api_key: Client(url, api_key=KEY), KEY the service's EPLB_API_KEY)"),
                      ("wrong", " (the client's api_key is not the service's key)")):
        with Client(base, api_key=key) as eplb, pytest.raises(ServiceError) as info:
            eplb.deployments()
        assert str(info.value) == refused + said and info.value.status == 401


SIXTEEN = [[40, 3, 9, 0, 12, 7, 30, 1, 5, 8, 2, 22, 6, 4, 11, 10], [0] * 16,
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
"""A window of 16 experts, which no model preset has (an answer without a model), its middle layer without tokens."""


def _nullable_required(model: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> list[str]:
    """Fields of `model` (and of the models inside it, at any depth) that may be None but have no default: the
    service leaves every None out of its answers (exclude_none), so such a field is missing from some answer."""
    seen = set() if seen is None else seen
    if model in seen:
        return []
    seen.add(model)
    found = []
    for name, field in model.model_fields.items():
        if field.is_required() and type(None) in get_args(field.annotation):  # X | None (not list[X | None])
            found.append(f"{model.__name__}.{name}")
        kinds = [field.annotation]
        while kinds:  # the models inside it: X | None, list[X], dict[str, X], ...
            kind = kinds.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += _nullable_required(kind, seen)
            kinds += get_args(kind)
    return found


def test_every_answer_model_takes_the_answers_without_their_absent_fields() -> None:
    """A field that may be None is optional in every model the client reads an answer with (Moves.bytes_moved was
    required: every answer without a model was 'not the eplb service's')."""
    models: list[type[BaseModel]] = [PlacementResponse, Job, DeploymentView, WindowResult, HistoryPage, HistoryEntry]
    assert [f for m in models for f in _nullable_required(m)] == []


def test_every_kind_of_answer_reads_back_through_the_models(
    base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real answers of each kind of request, read by the client's models: without a model (no times, no bytes
    moved), with the serving placement (moves, a plan), each solver, weighted shares, an evaluation, a job's result,
    a deployment's windows and history; and eplb solve --json's object, the same shape."""
    cluster = {"num_gpus": 4, "num_redundant": 4}
    later = [row[::-1] for row in SIXTEEN]
    with Client(base, api_key=KEY) as eplb:
        fresh = eplb.placement(cluster=cluster, loads=SIXTEEN)
        assert fresh.predicted.time_us is None and fresh.moves is None and fresh.predicted.lb[1] is None
        moved = eplb.placement(cluster=cluster, loads=later, current_placement=fresh.placement)
        assert moved.moves is not None and moved.moves.total > 0 and moved.moves.bytes_moved is None
        assert moved.plan is not None
        v3 = {"model": "deepseek-v3", "cluster": {"num_gpus": 32, "num_redundant": 32}, "loads": V3}
        timed = eplb.placement(**v3, current_placement=eplb.placement(**v3).placement, stage_gib=1)
        assert timed.moves is not None and timed.moves.bytes_moved is not None and timed.predicted.time_us
        for solver, more in (("deepseek", {}), ("milp", {"time_limit_s": 1}),
                             ("milp", {"time_limit_s": 1, "split": "weighted"}),
                             ("incremental", {"current_placement": fresh.placement, "max_moves": 1})):
            answer = eplb.placement(cluster=cluster, loads=later, solver=solver, **more)
            assert answer.solver is not None and answer.solver.name.startswith(solver)
            assert (answer.placement.shares is not None) == ("split" in more)
        judged = eplb.evaluate(loads=later, placement=moved.placement)
        assert judged.solver is None and judged.predicted.lb == moved.predicted.lb
        job = eplb.wait(eplb.submit(cluster=cluster, loads=SIXTEEN, current_placement=fresh.placement).id, 120)
        assert job.result is not None and job.result.moves is not None and job.result.moves.bytes_moved is None
        eplb.put_deployment("client-answers", config(trigger="periodic", every=2))
        actions = [eplb.send_window("client-answers", window(i)).action for i in range(3)]
        assert actions == ["placed", "kept", "rebalanced"]
        assert [e.action for e in eplb.history("client-answers").entries] == actions[::-1]
        assert eplb.deployment("client-answers").placement is not None
        eplb.delete_deployment("client-answers")
    from eplb.cli import main

    (tmp_path / "w.json").write_text(json.dumps({"loads": SIXTEEN}))
    (tmp_path / "c.json").write_text(json.dumps(fresh.placement.model_dump(exclude_none=True)))
    args = ["solve", "--loads", str(tmp_path / "w.json"), "--gpus", "4", "--redundant", "4", "--json"]
    assert main([*args, "--current", str(tmp_path / "c.json")]) == 0
    printed = PlacementResponse.model_validate_json(capsys.readouterr().out)
    assert printed.moves is not None and printed.moves.bytes_moved is None


def test_deployments_sync(base: str) -> None:
    with Client(base, api_key=KEY) as eplb:
        view = eplb.put_deployment("client-sync", config(threshold=1.1))
        assert view.name == "client-sync" and view.placement is None
        first = eplb.send_window("client-sync", np.asarray(window(0)))
        assert isinstance(first, WindowResult) and first.action == "placed" and first.result is not None
        moved = eplb.send_window("client-sync", window(1))
        assert moved.action == "rebalanced" and moved.result is not None and moved.result.plan is not None
        applied = eplb.applied("client-sync", first.result.placement)  # the cluster refused the new one
        assert applied.action == "applied" and applied.moves == moved.entry.moves
        assert eplb.deployment("client-sync").placement == first.result.placement
        page = eplb.history("client-sync", limit=2)
        assert [e.action for e in page.entries] == ["applied", "rebalanced"] and page.next is not None
        assert [e.action for e in eplb.history("client-sync", before=page.next).entries] == ["placed"]
        exported = eplb.export("client-sync", "trtllm")
        assert exported["num_slots"] == 80
        assert "client-sync" in [d.name for d in eplb.deployments()]
        from eplb.cli import main

        assert main(["deployments", "history", "client-sync", "--url", base, "--api-key", KEY, "--json"]) == 0
        eplb.delete_deployment("client-sync")
        with pytest.raises(ServiceError, match="404"):
            eplb.deployment("client-sync")


def test_put_deployment_says_whether_it_created_and_whether_it_dropped_the_placement(base: str) -> None:
    """The PUT's answer carries placement_dropped (and 201 for a new deployment); the client's DeploymentView had
    neither, so a caller could not tell a registered deployment from an updated one, nor see its placement go."""
    wider = config(threshold=1.1).model_copy(update={"cluster": ClusterShape(num_gpus=8, slots_per_gpu=12)})

    def told(view: DeploymentUpdate) -> tuple[bool, bool, bool]:
        """(created, a placement serves, the PUT dropped one)."""
        dropped = view.placement_dropped
        assert dropped is None or "no longer fits the new config" in dropped
        return view.created, view.placement is not None, dropped is not None

    with Client(base, api_key=KEY) as eplb:
        assert told(eplb.put_deployment("client-put", config(threshold=1.1))) == (True, False, False)
        assert told(eplb.put_deployment("client-put", config(threshold=1.2))) == (False, False, False)
        eplb.send_window("client-put", window(0))
        assert told(eplb.put_deployment("client-put", config(threshold=1.1))) == (False, True, False)  # same slots
        assert told(eplb.put_deployment("client-put", wider)) == (False, False, True)  # 12 slots per GPU, not 10
        eplb.delete_deployment("client-put")

    async def run() -> None:
        async with AsyncClient(base, api_key=KEY) as eplb:
            assert told(await eplb.put_deployment("client-put-async", config())) == (True, False, False)
            await eplb.send_window("client-put-async", window(0))
            assert told(await eplb.put_deployment("client-put-async", wider)) == (False, False, True)
            await eplb.delete_deployment("client-put-async")

    asyncio.run(run())


def test_async_client(base: str) -> None:
    async def run() -> None:
        async with AsyncClient(base, api_key=KEY) as eplb:
            await eplb.put_deployment("client-async", config(trigger="periodic", every=2))
            actions = [(await eplb.send_window("client-async", window(i))).action for i in range(3)]
            assert actions == ["placed", "kept", "rebalanced"]
            job = await eplb.submit(**request())
            assert (await eplb.wait(job.id, timeout=120)).status == "done"
            answer = await eplb.placement(**request())
            assert answer.placement.num_gpus == 16
            await eplb.delete_deployment("client-async")

    asyncio.run(run())


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens on it once the socket is closed


@pytest.mark.parametrize("argv", [["deployments", "list"], ["deployments", "show", "prod"],
                                  ["deployments", "history", "prod"], ["history", "prod", "--plot", "h.png"]])
def test_every_deployments_command_says_in_one_line_when_the_service_cannot_be_reached(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from eplb.cli import main

    refused = f"http://127.0.0.1:{_closed_port()}"
    assert main([*argv, "--url", refused]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(error_prefix(argv) + f"cannot reach {refused}: ") and "Connection refused" in err
    assert main([*argv, "--url", "notaurl"]) == 2  # refused before any request
    assert capsys.readouterr().err == error_prefix(argv) + ("--url is no http(s) URL of a host (e.g. "
                                                            "http://127.0.0.1:8000), got 'notaurl'\n")


def test_unreachable_and_foreign_services_are_one_line_errors() -> None:
    import httpx

    from eplb.client import NotTheService, Unreachable

    for url in ("notaurl", "localhost:8000", "http://", "ftp://127.0.0.1", "http://127.0.0.1:99999"):
        with pytest.raises(InvalidRequest, match=r"^base_url is no http\(s\) URL of a host \(e.g. http://127.0.0.1:8000"
                                                 rf"\), got '{re.escape(url)}'$"):
            Client(url)  # 'localhost:8000' was 'cannot reach ... unsupported protocol 'localhost://'' at the first call
    with pytest.raises(Unreachable, match=r"^cannot reach http://bad\x00: Invalid non-printable"):
        Client("http://bad\x00")

    async def refused() -> None:
        async with AsyncClient(f"http://127.0.0.1:{_closed_port()}") as eplb:
            await eplb.deployments()

    with pytest.raises(Unreachable, match=r"^cannot reach http://127.0.0.1:\d+: "):
        asyncio.run(refused())
    page = "<!DOCTYPE html>\n<html>\n<body>\n<h1>Hello</h1>\n</body>\n</html>\n"

    def other_server(request: httpx.Request) -> httpx.Response:
        status = 404 if request.url.path.endswith("gone") else 200
        return httpx.Response(status, text=page, headers={"content-type": "text/html; charset=utf-8"})

    with Client("http://web.example", transport=httpx.MockTransport(other_server)) as eplb:
        with pytest.raises(NotTheService, match=r"^GET http://web.example/deployments: the answer \(HTTP 200, "
                                                r"text/html\) is not the eplb service's"):
            eplb.deployments()
        with pytest.raises(ServiceError, match=r"^404 Not Found: a text/html answer, no problem details") as gone:
            eplb.deployment("gone")
        assert gone.value.status == 404 and "\n" not in str(gone.value)


def test_a_base_url_with_a_path_the_service_has_not_is_said_so(base: str) -> None:
    """Client("http://HOST:PORT/api") raised '404 Not Found: Not Found' at every call: the 404 of no route is said as
    one, naming the path and the base URL to check; a missing deployment keeps the service's own detail."""
    with Client(base + "/api", api_key=KEY) as eplb, pytest.raises(ServiceError) as no_route:
        eplb.deployments()
    assert no_route.value.status == 404 and str(no_route.value) == (
        f"404 Not Found: no route /api/deployments on the service at {base}: is the client's base URL that of `eplb "
        "serve` (http://HOST:PORT, with no path unless a proxy serves it under one)?")
    with Client(base, api_key=KEY) as eplb, pytest.raises(ServiceError, match="no deployment named 'absent'"):
        eplb.deployment("absent")


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), 1e12, True, "5"])
def test_a_timeout_that_is_no_wait_is_a_one_line_error(timeout: Any) -> None:
    """Client(url, timeout=0) or -1 raised 'Timeout value out of range' from socket.py at the first call, inf or 1e12
    OverflowError; now InvalidRequest at once, by the rule of the plug-ins' EPLB_SERVICE_TIMEOUT_S."""
    for client in (Client, AsyncClient):
        with pytest.raises(InvalidRequest, match=r"^timeout must be a number of seconds above 0 and at most 86,400 "
                                                 r"\(a day\), got ") as refused:
            client(f"http://127.0.0.1:{_closed_port()}", timeout=timeout).deployments()
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("timeout", [float("nan"), -1, 0, "5", float("inf")])
def test_a_wait_timeout_that_is_no_wait_is_a_one_line_error(base: str, timeout: Any) -> None:
    """wait(job, timeout=nan) polled forever (no comparison with NaN is true), '5' raised TypeError from
    time.monotonic() + '5', -1 and 0 gave up at once with 'still running after -1 s': each is InvalidRequest now,
    before any poll, by the rule of the client's own timeout; None waits without limit."""
    refused = f"wait's timeout must be a number of seconds above 0 and at most 86,400 (a day), got {timeout!r}"
    with Client(base, api_key=KEY) as eplb:
        job = eplb.submit(**request())
        with pytest.raises(InvalidRequest, match=f"^{re.escape(refused)} \\(or None: no limit\\)$"):
            eplb.wait(job.id, timeout=timeout)

        async def waits() -> None:
            async with AsyncClient(base, api_key=KEY) as other:
                await other.wait(job.id, timeout=timeout)

        with pytest.raises(InvalidRequest, match=f"^{re.escape(refused)}"):
            asyncio.run(waits())
        assert eplb.wait(job.id, timeout=None).status == "done"


def test_a_closed_client_says_so_in_one_line(base: str) -> None:
    """A call after close() (or the with block) raised httpx's RuntimeError; now InvalidRequest."""
    with Client(base, api_key=KEY) as eplb:
        eplb.deployments()
    with pytest.raises(InvalidRequest, match=r"^this Client is closed \(close\(\), or the end of its with block\): "
                                             r"open a new one$"):
        eplb.deployments()

    async def closed() -> None:
        async with AsyncClient(base, api_key=KEY) as client:
            await client.deployments()
        await client.deployments()

    with pytest.raises(InvalidRequest, match=r"^this AsyncClient is closed"):
        asyncio.run(closed())


# --- what the client sends ----------------------------------------------------------------------------------


def test_deployment_names_reach_their_own_deployment(base: str) -> None:
    """A name is one path segment: '#', '?' or '/' in it cannot cut the path short (`delete_deployment(
    "victim#test")` deleted `victim`) or reach another route; the service's names are refused in one line."""
    with Client(base, api_key=KEY) as eplb:
        eplb.put_deployment("victim", config())
        eplb.send_window("victim", window(0))
        calls: list[Callable[[str], object]] = [
            lambda n: eplb.delete_deployment(n), lambda n: eplb.put_deployment(n, config()),
            lambda n: eplb.deployment(n), lambda n: eplb.send_window(n, window(1)),
            lambda n: eplb.history(n), lambda n: eplb.export(n, "sglang")]
        for name in ("victim#test", "victim?format=sglang", "victim/history", "victim/../victim", "", "-victim"):
            for call in calls:
                with pytest.raises(InvalidRequest, match=r"^deployment name .*: use 1-100 letters, digits"):
                    call(name)
        assert eplb.deployment("victim").windows == 1  # neither deleted, replaced nor sent a window
        assert [e.action for e in eplb.history("victim").entries] == ["placed"]
        assert [d.name for d in eplb.deployments() if d.name.startswith("victim")] == ["victim"]
        name = "Victim.2_b-c"  # every character the service allows, through every call
        eplb.put_deployment(name, config())
        first = eplb.send_window(name, window(0))
        assert first.result is not None and eplb.applied(name, first.result.placement).id == first.history_id
        assert eplb.deployment(name).name == name and len(eplb.history(name).entries) == 1  # it served already
        assert eplb.export(name, "trtllm")["num_slots"] == 80
        eplb.delete_deployment(name)
        eplb.delete_deployment("victim")

    async def run() -> None:
        async with AsyncClient(base, api_key=KEY) as eplb:
            with pytest.raises(InvalidRequest, match="deployment name 'a#b'"):
                await eplb.put_deployment("a#b", config())
            assert "a" not in [d.name for d in await eplb.deployments()]

    asyncio.run(run())


def test_job_ids_are_escaped(base: str) -> None:
    """A job id is one path segment too: the service is asked about the id as given, not a prefix of it."""
    with Client(base, api_key=KEY) as eplb:
        job = eplb.submit(**request())
        for suffix in ("#x", "?x=1"):
            with pytest.raises(ServiceError) as missing:
                eplb.job(job.id + suffix)
            assert missing.value.status == 404, suffix
            assert repr(job.id + suffix) in missing.value.detail
            with pytest.raises(ServiceError, match="404"):
                eplb.cancel(job.id + suffix)
        assert eplb.wait(job.id, timeout=120).status == "done"  # not cancelled
        # the service decodes %2F into a path of its own, which no route has ('404 Not Found: Not Found'): not sent
        for bad in ("..", job.id + "/x", "../x"):
            for call in (eplb.job, eplb.cancel, eplb.wait):
                with pytest.raises(InvalidRequest, match=f"^job id {re.escape(repr(bad))}: the id a submitted job "):
                    call(bad)


def test_numpy_values_at_any_depth(base: str) -> None:
    """numpy scalars and arrays inside the cluster, a placement or a list of rows are sent as JSON numbers."""
    loads = np.asarray(window(0))
    with Client(base, api_key=KEY) as eplb:
        plain = eplb.placement(model=MODEL, cluster={"num_gpus": 8, "slots_per_gpu": 10}, loads=loads)
        for cluster in ({"num_gpus": np.int64(8), "slots_per_gpu": np.int32(10)},
                        {"num_gpus": 8, "slots_per_gpu": np.full(8, 10)},
                        {"num_gpus": 8, "slots_per_gpu": [np.int64(10)] * 8}):
            answer = eplb.placement(model=MODEL, cluster=cluster, loads=list(loads))  # a list of arrays
            assert answer.placement.phy2log == plain.placement.phy2log
        placement = plain.placement.model_dump()
        placement["phy2log"] = np.asarray(placement["phy2log"])
        judged = eplb.evaluate(model=MODEL, loads=[[np.float32(x) for x in row] for row in loads],
                               placement=placement)
        assert judged.predicted.lb == pytest.approx(plain.predicted.lb)
        view = eplb.put_deployment("client-numpy", {"model": MODEL, "cluster": {
            "num_gpus": np.int64(8), "num_redundant": np.uint16(16)}, "policy": {"threshold": np.float64(1.2)}})
        assert view.config.cluster.num_gpus == 8 and view.config.policy.threshold == 1.2
        eplb.delete_deployment("client-numpy")


def test_values_json_cannot_carry_are_one_line_errors(base: str) -> None:
    """NaN and infinity (anywhere in a request) and objects JSON has no form for name their field."""
    nan_rows = np.asarray(window(0), dtype=np.float64)
    nan_rows[1, 3] = np.nan
    with Client(base, api_key=KEY) as eplb:
        eplb.put_deployment("client-nan", config())
        cases: list[tuple[Callable[[], Any], str]] = [
            (lambda: eplb.placement(model=MODEL, cluster={"num_gpus": 8}, loads=nan_rows),
             r"^loads\[1\]\[3\] is nan: the service takes finite numbers \(JSON has no NaN or infinity\)$"),
            (lambda: eplb.placement(model=MODEL, cluster={"num_gpus": 8}, loads=nan_rows.tolist()),
             r"^loads\[1\]\[3\] is nan: "),
            (lambda: eplb.send_window("client-nan", [[1.0, float("inf")]]), r"^loads\[0\]\[1\] is inf: "),
            (lambda: eplb.placement(model=MODEL, cluster={"num_gpus": 8, "memory_budget_bytes": [np.inf]},
                                    loads=window(0)), r"^cluster\.memory_budget_bytes\[0\] is inf: "),
            (lambda: eplb.evaluate(loads=window(0), placement={"phy2log": {1, 2}}),
             r"^placement\.phy2log is a set: JSON has numbers, strings, lists and objects$"),
            (lambda: eplb.placement(model=MODEL, cluster={"num_gpus": 8}, loads=object()),
             r"^loads is an object: JSON has numbers"),  # was 'is a object'
            (lambda: eplb.placement(model=MODEL, cluster={"num_gpus": 8}, loads=[[1 + 2j]]),
             r"^loads\[0\]\[0\] is a complex: JSON has numbers"),
            (lambda: eplb.put_deployment("client-nan", {"model": MODEL, "cluster": {"num_gpus": 8},
                                                         "tokens_per_gpu": float("nan")}),
             r"^config\.tokens_per_gpu is nan: "),
        ]
        for call, message in cases:
            with pytest.raises(InvalidRequest, match=message) as err:
                call()
            assert "\n" not in str(err.value)
        assert eplb.deployment("client-nan").windows == 0
        eplb.delete_deployment("client-nan")


def test_a_config_the_service_refuses_is_a_one_line_error_naming_the_field(base: str) -> None:
    """The service judges a config (the client sends a dict as given): its 422 is InvalidConfig, one line naming
    the fields of the answer's errors, and a ServiceError with the service's status and errors."""
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"model": "nosuch"}, r"^deployment config: cluster: Field required$", "cluster"),
        ({"model": MODEL, "cluster": {"num_gpus": 2, "slots_per_gpu": [9, 0]}, "policy": {"trigger": "sometimes"}},
         r"^deployment config: cluster\.slots_per_gpu\[1\] is 0: slot counts are whole numbers from 1 to 4,096; "
         r"policy\.trigger: Input should be 'periodic', 'threshold' or 'cost'$", "cluster.slots_per_gpu"),
        ({"model": MODEL, "cluster": {"num_gpus": 2, "slots_per_gpu": 9, "num_redundant": 2}},
         r"^deployment config: cluster: give only one of slots_per_gpu, num_redundant, memory_budget_bytes", None),
        ({"model": "nosuch", "cluster": {"num_gpus": 4}}, r"^deployment config: model: unknown preset 'nosuch'",
         "model"),  # the service's own check, after the model's
        ({"model": MODEL, "cluster": {"num_gpus": 4}, "colour": "red"},
         r"^deployment config: colour: Extra inputs are not permitted$", "colour"),
        ({"model": MODEL, "cluster": {"num_gpus": 4}, "tokens_per_gpu": "4096"},
         r"^deployment config: tokens_per_gpu: Input should be a valid number$", "tokens_per_gpu"),
    ]
    with Client(base, api_key=KEY) as eplb:
        for body, message, field in cases:
            with pytest.raises(InvalidConfig, match=message) as err:
                eplb.put_deployment("client-refused", body)
            assert "\n" not in str(err.value) and isinstance(err.value, InvalidRequest)
            assert isinstance(err.value, ServiceError) and err.value.status == 422
            if field is not None:
                assert field in [e["field"] for e in err.value.errors]
        assert "client-refused" not in [d.name for d in eplb.deployments()]

    async def run() -> None:
        async with AsyncClient(base, api_key=KEY) as eplb:
            with pytest.raises(InvalidConfig, match=r"^deployment config: colour: Extra inputs"):
                await eplb.put_deployment("client-refused", {**cases[4][0]})

    asyncio.run(run())


def test_a_refused_config_names_every_field_of_the_answer() -> None:
    """Fields sharing one message are named together; a rule across fields ('body') names none but its message;
    an answer without errors is its detail; other errors than 422 stay ServiceError (a 503 sent again, eplb.retry)."""
    answers: Iterator[tuple[int, dict[str, Any]]] = itertools.chain([
        (422, {"title": "Invalid request", "detail": "solver 'greedy' does not take max_moves", "errors": [
            {"field": "solver", "message": "solver 'greedy' does not take max_moves"},
            {"field": "policy.max_moves", "message": "solver 'greedy' does not take max_moves"}]}),
        (422, {"title": "Invalid request", "detail": "body: cluster: give only one of ...", "errors": [
            {"field": "body", "message": "cluster: give only\none of ..."}]}),
        (422, {"title": "Invalid request", "detail": "model: unknown\npreset"}),
    ], itertools.repeat((503, {"title": "Service busy", "detail": "try later"})))

    def service(request: httpx.Request) -> httpx.Response:
        status, body = next(answers)
        return httpx.Response(status, json={"status": status, **body})

    with Client("http://svc", transport=httpx.MockTransport(service)) as eplb:
        for message in (r"^deployment config: solver, policy\.max_moves: solver 'greedy' does not take max_moves$",
                        r"^deployment config: cluster: give only one of \.\.\.$",
                        r"^deployment config: model: unknown preset$"):
            with pytest.raises(InvalidConfig, match=message):
                eplb.put_deployment("prod", {"model": MODEL, "cluster": {"num_gpus": 4}})
        with pytest.raises(ServiceError, match=r"^503 Service busy: try later \(attempt 3, after answered 503: "
                                               r"try later \(2 times\)\)$") as busy:
            eplb.put_deployment("prod", {"model": MODEL, "cluster": {"num_gpus": 4}})
        assert not isinstance(busy.value, InvalidRequest)


def test_a_newer_services_config_fields_are_sent_and_read() -> None:
    """The client does not judge a config dict with its own model: a field a newer service takes reaches it, and
    the service's answer, which holds it, is read (the field left out of the typed view)."""
    sent: list[dict[str, object]] = []

    def newer_service(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        if body is not None:
            sent.append(body)
        config = {"model": MODEL, "hardware": "b200", "cluster": {"num_gpus": 8, "num_redundant": 8,
                                                                  "racks": 2},
                  "policy": {"trigger": "threshold", "threshold": 1.1, "forecast": "ewma"}, "placement_group": "a"}
        view = {"name": "prod", "config": config, "windows": 0, "created_at": 0.0, "updated_at": 0.0}
        if request.method == "GET" and request.url.path == "/deployments":
            return httpx.Response(200, json={"deployments": [view]})
        return httpx.Response(201 if request.method == "PUT" else 200, json=view)

    new = {"model": MODEL, "cluster": {"num_gpus": 8, "racks": 2}, "policy": {"forecast": "ewma"},
           "placement_group": "a"}
    with Client("http://svc", transport=httpx.MockTransport(newer_service)) as eplb:
        view = eplb.put_deployment("prod", new)
        assert sent == [new]
        assert view.config.cluster.num_gpus == 8 and view.config.policy.threshold == 1.1
        assert eplb.deployment("prod").config == view.config == eplb.deployments()[0].config


def test_put_deployment_sends_only_the_fields_set() -> None:
    """Defaults the caller did not set stay out of the body, so a newer client's new fields (with their
    defaults) never reach an older service that refuses fields it does not know."""
    sent: list[dict[str, object]] = []

    def older_service(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        sent.append(body)
        known = {"model", "hardware", "cluster", "policy", "solver"}  # no 'link', 'objective', ...
        if set(body) - known or set(body.get("policy", {})) - {"trigger", "threshold"}:
            return httpx.Response(422, json={"title": "Invalid request", "detail": "extra inputs are not permitted"})
        view = {"name": "prod", "config": DeploymentConfig.model_validate(body).model_dump(mode="json"),
                "windows": 0, "created_at": 0.0, "updated_at": 0.0}
        return httpx.Response(201, json=view)

    with Client("http://svc", transport=httpx.MockTransport(older_service)) as eplb:
        eplb.put_deployment("prod", {"model": MODEL, "cluster": {"num_gpus": np.int64(32)},
                                     "policy": {"threshold": 1.05}})
        eplb.put_deployment("prod", DeploymentConfig(model=MODEL, cluster=ClusterShape(num_gpus=32,
                                                                                                 num_redundant=32)))
    assert sent == [{"model": MODEL, "cluster": {"num_gpus": 32}, "policy": {"threshold": 1.05}},
                    {"model": MODEL, "cluster": {"num_gpus": 32, "num_redundant": 32}}]


# --- windows with a co-activation summary; applied placements -----------------------------------------------

LAW = Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"  # 26 layers of MODEL


def test_placement_evaluate_and_submit_take_coactivation_in_every_form_send_window_does(base: str) -> None:
    """placement(coactivation=<CoactivationSummary>) raised 'coactivation is a CoactivationSummary: JSON has
    numbers...' while send_window took it: the request keywords send it as send_window does (one conversion)."""
    from eplb.coactivation import read_topk, summarize
    from eplb.io.windows import read_window

    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads
    summary = summarize(ids, 64)
    image = summary.to_bytes()
    forms: list[Coactivation] = [summary, summary.to_dict(), image, base64.b64encode(image).decode()]
    setup = {"model": MODEL, "hardware": "h800", "tokens_per_gpu": 256, "loads": loads}
    cluster = {"num_gpus": 8, "slots_per_gpu": 9}
    with Client(base, api_key=KEY) as eplb:
        copies = []
        for form in forms:
            placed = eplb.placement(**setup, cluster=cluster, solver="greedy-coact", coactivation=form)
            assert placed.solver is not None and placed.solver.name == "greedy-coact"
            assert placed.predicted.copies_per_token is not None
            judged = eplb.evaluate(**setup, placement=placed.placement, coactivation=form)
            assert judged.predicted.copies_per_token == placed.predicted.copies_per_token
            copies.append(placed.predicted.copies_per_token.gpus)
            job = eplb.wait(eplb.submit(**setup, cluster=cluster, solver="greedy-coact", coactivation=form).id)
            assert job.result is not None and job.result.predicted.copies_per_token == placed.predicted.copies_per_token
        assert all(c == copies[0] for c in copies)
        assert eplb.placement(**setup, cluster=cluster, coactivation=None).predicted.copies_per_token is None
        with pytest.raises(InvalidRequest, match=r"^coactivation: a CoactivationSummary, its dict .* not a list$"):
            eplb.placement(**setup, cluster=cluster, coactivation=[1, 2])

    async def run() -> None:
        async with AsyncClient(base, api_key=KEY) as client:
            placed = await client.placement(**setup, cluster=cluster, solver="greedy-coact", coactivation=summary)
            assert placed.predicted.copies_per_token is not None

    asyncio.run(run())


def test_windows_carry_a_coactivation_summary_in_every_form(served: tuple[str, str]) -> None:
    """send_window's coactivation (a CoactivationSummary, its dict, its .npz image or base64 of it) reaches the
    deployment: the predictions count the GPUs a token reaches, and the history keeps the summary, kept windows'
    too; a window without one keeps none."""
    from eplb import deployments as dep
    from eplb.coactivation import read_topk, summarize
    from eplb.io.windows import read_window
    from eplb.store import open_store

    base, db = served
    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads
    summary = summarize(ids, 64)
    image = summary.to_bytes()
    forms: list[Coactivation] = [summary, summary.to_dict(), image, base64.b64encode(image).decode()]
    store = open_store(db, upgrade=False)
    with Client(base, api_key=KEY) as eplb:
        eplb.put_deployment("client-coact", {"model": MODEL, "hardware": "h800", "link": "nic",
                                             "tokens_per_gpu": 256.0, "cluster": {"num_gpus": 8, "slots_per_gpu": 9},
                                             "policy": {"threshold": 1000.0}})
        copies = []
        for form in forms:
            answer = eplb.send_window("client-coact", loads, force=True, coactivation=form)
            assert answer.action in ("placed", "rebalanced") and answer.result is not None
            assert answer.result.predicted.copies_per_token is not None
            copies.append(answer.result.predicted.copies_per_token.gpus)
            kept = dep.window_coactivation(store, answer.history_id)
            assert kept is not None and kept.to_dict() == summary.to_dict(), type(form)
        assert len(copies[0]) == 26 and all(c == copies[0] for c in copies)
        judged = eplb.send_window("client-coact", loads, coactivation=summary)  # under the threshold: kept
        assert judged.action == "kept" and judged.result is None
        assert dep.window_coactivation(store, judged.history_id) is not None
        plain = eplb.send_window("client-coact", loads, force=True)
        assert plain.result is not None and plain.result.predicted.copies_per_token is None
        assert dep.window_coactivation(store, plain.history_id) is None
        with pytest.raises(InvalidRequest, match=r"^coactivation: a CoactivationSummary, its dict .* not a list$"):
            eplb.send_window("client-coact", loads, coactivation=[1, 2])  # type: ignore[arg-type]
        with pytest.raises(ServiceError, match=r"^422 Invalid request: coactivation: the summary is for 3 layers"):
            eplb.send_window("client-coact", loads, coactivation=summary.layers(3))
        windows = eplb.deployment("client-coact").windows

        async def run() -> None:
            async with AsyncClient(base, api_key=KEY) as client:
                answer = await client.send_window("client-coact", loads, force=True, coactivation=summary)
                assert answer.result is not None and answer.result.predicted.copies_per_token is not None
                assert dep.window_coactivation(store, answer.history_id) is not None

        asyncio.run(run())
        assert eplb.deployment("client-coact").windows == windows + 1  # the refused ones were not counted
        eplb.delete_deployment("client-coact")
    store.close()


def test_applied_sends_every_field_of_the_placement(base: str) -> None:
    """applied() passes on the whole placement (a placement file's layer_ids, replicas, format, num_gpus): the
    service checks them (layer_ids for another layer count is its 422 naming the field)."""
    with Client(base, api_key=KEY) as eplb:
        eplb.put_deployment("client-applied", config())
        first = eplb.send_window("client-applied", window(0))
        assert first.result is not None
        placement = first.result.placement.model_dump(exclude_none=True)
        with pytest.raises(ServiceError, match=r"^422 Invalid request: .*layer_ids: 2 ids for the placement's 4"):
            eplb.applied("client-applied", {**placement, "layer_ids": [3, 4]})
        with pytest.raises(ServiceError, match=r"^422 Invalid request: .*replicas"):
            eplb.applied("client-applied", {**placement, "replicas": [[1] * 64] * 4})  # not phy2log's counts
        entry = eplb.applied("client-applied", {**placement, "layer_ids": [3, 4, 5, 6]})
        assert entry.id == first.history_id  # taken; it serves already: the entry that placed it, nothing recorded
        eplb.delete_deployment("client-applied")
    sent: list[dict[str, object]] = []

    def service(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"id": 1, "seq": 1, "at": 0.0, "action": "applied", "reason": "reported"})

    given = {**placement, "layer_ids": np.arange(3, 7), "shares": None}
    with Client("http://svc", transport=httpx.MockTransport(service)) as eplb:
        eplb.applied("prod", given)
        eplb.applied("prod", first.result.placement)
    assert sent == [{"placement": {**placement, "layer_ids": [3, 4, 5, 6]}}, {"placement": placement}]
    assert set(placement) == {"format", "num_experts", "num_gpus", "slots_per_gpu", "phy2log", "replicas"}


def test_a_window_carries_the_serving_placement_and_is_answered_once(base: str) -> None:
    """send_window(current_placement=...) (a PlacementOut or its dict): the service records it as serving before the
    window when it holds another; the same window sent again (a retry, another rank, the async client) gets the same
    answer and stores nothing. A current_placement that is no placement object is refused unsent."""
    with Client(base, api_key=KEY) as eplb:
        eplb.put_deployment("client-current", config(trigger="periodic"))
        first = eplb.send_window("client-current", window(0))
        assert first.result is not None
        serving = first.result.placement.model_copy(update={"phy2log": np.roll(first.result.placement.phy2log, 10,
                                                                                axis=1).tolist()})
        moved = eplb.send_window("client-current", window(1), current_placement=serving)
        assert moved.action == "rebalanced" and moved.window_key is not None
        again = eplb.send_window("client-current", np.asarray(window(1)),
                                 current_placement=serving.model_dump(exclude_none=True))
        assert again == moved
        assert [e.action for e in eplb.history("client-current").entries] == ["rebalanced", "applied", "placed"]
        with pytest.raises(InvalidRequest, match=r"^current_placement: a placement object .* not a list$"):
            eplb.send_window("client-current", window(1), current_placement=[[0, 1]])  # type: ignore[arg-type]

    async def run() -> WindowResult:
        async with AsyncClient(base, api_key=KEY) as client:
            return await client.send_window("client-current", window(1), current_placement=serving)

    assert asyncio.run(run()) == moved
    with Client(base, api_key=KEY) as eplb:
        assert eplb.deployment("client-current").windows == 2
        eplb.delete_deployment("client-current")


def test_export_sends_the_layer_ids(base: str) -> None:
    """docs/api.md documents `&layer_ids=` for GET /deployments/{name}?format=..., but the client's export() could
    not send it: a window of a part of the model got rows 0..L-1. A string goes as given, ints as ranges."""
    with Client(base, api_key=KEY) as eplb:
        eplb.put_deployment("client-layers", config())
        placed = eplb.send_window("client-layers", window(0))
        assert placed.result is not None
        phy2log = placed.result.placement.phy2log  # 4 of deepseek-v2-lite's 27 layers
        assert list(eplb.export("client-layers", "trtllm")["initial_global_assignments"]) == ["0", "1", "2", "3"]
        for ids, keys in (("10-13", [10, 11, 12, 13]), ([1, 5, 6, 7], [1, 5, 6, 7]), (np.arange(20, 24), None)):
            exported = eplb.export("client-layers", "trtllm", layer_ids=ids)["initial_global_assignments"]
            assert [int(k) for k in exported] == (keys or list(range(20, 24)))
            assert list(exported.values()) == phy2log
        rows = eplb.export("client-layers", "sglang", layer_ids=[26, 3, 4, 5])["physical_to_logical_map"]
        assert len(rows) == 27 and rows[26] == phy2log[0] and rows[3:6] == phy2log[1:]
        with pytest.raises(ServiceError) as beyond:
            eplb.export("client-layers", "sglang", layer_ids=[24, 25, 26, 27])
        assert beyond.value.status == 422 and "beyond the model's 27 layers" in beyond.value.detail
        assert [e["field"] for e in beyond.value.errors or []] == ["query.layer_ids"]
        for bad in ([1, -2, 3, 4], [], [1.0, 2, 3, 4], [True, 2, 3, 4], 7):
            with pytest.raises(InvalidRequest, match=r"^layer_ids: "):
                eplb.export("client-layers", "trtllm", layer_ids=bad)  # type: ignore[arg-type]

    async def run() -> dict[str, Any]:
        async with AsyncClient(base, api_key=KEY) as client:
            return await client.export("client-layers", "trtllm", layer_ids="3-6")

    assert list(asyncio.run(run())["initial_global_assignments"]) == ["3", "4", "5", "6"]
    with Client(base, api_key=KEY) as eplb:
        eplb.delete_deployment("client-layers")


# --- retries: the plug-ins' rule (eplb.retry) -------------------------------------------------------------------


def _path_ends(method: str, suffix: str) -> Callable[[str, str], bool]:
    """The requests a flaky proxy's script counts: `method` to a path ending in `suffix`."""
    return lambda m, path: m == method and path.split("?")[0].endswith(suffix)


def test_a_call_that_fails_once_is_sent_again_by_the_plug_ins_rule(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client raised at the first failed answer while the engine plug-ins sent the same request again
    (eplb.retry.RETRIES) for what another attempt can mend. Through a real proxy in front of `eplb serve`: a reset,
    then a 502: the third attempt's answer, one window stored; a 504, then a 500: the 500 is not sent again and says
    what came before it; a window whose answer came too late: the retry gets the stored answer (its window key), the
    window processed once; the async client and a GET alike; a call not safe to repeat (an applied placement) is not
    sent again after a 502."""
    monkeypatch.setattr(retry, "BACKOFF_S", (0.01, 0.01))
    with Client(base, api_key=KEY) as direct:
        direct.put_deployment("client-retry", config(trigger="periodic"))
    with proxy(base, {1: "drop", 2: 502}) as (url, log), Client(url, api_key=KEY) as eplb:
        first = eplb.send_window("client-retry", window(0))
    assert first.action == "placed" and first.result is not None
    assert log == [(1, "drop"), (2, "502"), (3, "forwarded")]
    with proxy(base, {1: 504, 2: 500}) as (url, log), Client(url, api_key=KEY) as eplb, \
            pytest.raises(ServiceError) as crashed:
        eplb.send_window("client-retry", window(1))
    assert crashed.value.status == 500 and log == [(1, "504"), (2, "500")]
    assert str(crashed.value).endswith("(attempt 2, after answered 504: the proxy's 504)"), str(crashed.value)
    reserve = retry.reserve_s
    monkeypatch.setattr(retry, "reserve_s", lambda timeout_s: timeout_s - 0.5)  # the first attempt waits 0.5 s
    with proxy(base, {1: "late"}) as (url, log), Client(url, api_key=KEY, timeout=60) as eplb:
        late = eplb.send_window("client-retry", window(1))
    monkeypatch.setattr(retry, "reserve_s", reserve)
    assert log == [(1, "late"), (2, "forwarded")] and late.action == "rebalanced"
    with Client(base, api_key=KEY) as direct:
        assert direct.send_window("client-retry", window(1)) == late  # the stored answer: one window
        assert direct.deployment("client-retry").windows == 2

    async def run(url: str) -> WindowResult:
        async with AsyncClient(url, api_key=KEY) as client:
            return await client.send_window("client-retry", window(1))

    with proxy(base, {1: 503}) as (url, log):
        assert asyncio.run(run(url)) == late and log == [(1, "503"), (2, "forwarded")]
    with proxy(base, {1: 503, 2: 503}, _path_ends("GET", "/deployments/client-retry")) as (url, log), \
            Client(url, api_key=KEY) as eplb:
        assert eplb.deployment("client-retry").windows == 2 and len(log) == 3
    assert late.result is not None
    with proxy(base, {1: 502}, _path_ends("POST", "/placement")) as (url, log), Client(url, api_key=KEY) as eplb, \
            pytest.raises(ServiceError, match=r"^502 Bad Gateway: the proxy's 502$"):
        eplb.applied("client-retry", late.result.placement)
    assert log == [(1, "502")]
    with Client(base, api_key=KEY) as direct:
        assert [e.action for e in direct.history("client-retry").entries] == ["rebalanced", "placed"]
        direct.delete_deployment("client-retry")


def test_a_busy_services_retry_after_is_honoured_within_the_timeout(
    base: str, server_factory: Callable[..., str]
) -> None:
    """The service answers 503 with Retry-After (EPLB_RETRY_AFTER_S, 5 s by default) when every solver is busy, but
    the rule sent the call again 0.1 s and 0.3 s later: three 503s within half a second. A real `eplb serve` whose
    one solver process runs a MILP job (Retry-After: 2), through a proxy that counts the solves: with a 3 s timeout
    the second attempt waits the 2 s and no third is made (its 2 s would pass the timeout), the error saying so; with
    1.5 s one attempt, answered at once. A proxy's 503 with Retry-After: 1, once: the call waits 1 s, then succeeds."""
    busy = server_factory(solver_workers="1", queue_limit="0", async_threshold_s="5", retry_after_s="2", api_key=KEY)
    milp = {**request(), "solver": "milp"}
    with Client(busy, api_key=KEY) as direct:
        job = direct.submit(**milp, time_limit_s=60)
        deadline = time.monotonic() + 60
        while direct.job(job.id).status != "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        try:
            for timeout, made in ((3.0, 2), (1.5, 1)):
                with proxy(busy, {}, _path_ends("POST", "/placement")) as (url, log), \
                        Client(url, api_key=KEY, timeout=timeout) as eplb, pytest.raises(ServiceError) as refused:
                    start = time.monotonic()
                    try:
                        eplb.placement(**milp, time_limit_s=2)
                    finally:
                        took = time.monotonic() - start
                message = str(refused.value)
                assert refused.value.status == 503 and len(log) == made, (log, message)
                assert (2.0 if made == 2 else 0.0) <= took < (timeout if made == 2 else 1.0), (took, message)
                assert message.startswith("503 Service busy: every solver worker is busy and the wait queue is full")
                assert re.search(rf"\(Retry-After 2 s: more than the [0-9.]+ s left of the call's {timeout:g} s "
                                 r"timeout, not sent again\)$", message), message
        finally:
            direct.cancel(job.id)
    with proxy(base, {1: 503}, _path_ends("GET", "/deployments"), retry_after="1") as (url, log), \
            Client(url, api_key=KEY, timeout=10) as eplb:
        start = time.monotonic()
        eplb.deployments()
        assert time.monotonic() - start >= 1.0 and log == [(1, "503"), (2, "forwarded")]


def test_retry_after_is_read_as_seconds_or_a_date_for_every_status_sent_again() -> None:
    """Retry-After is delay-seconds or an HTTP-date (RFC 9110); one that does not read, or asks less than the
    backoff, leaves the backoff; a 429 (a rate limit in front of the service) is sent again like a 503."""
    later = email.utils.formatdate(time.time() + 2.5, usegmt=True)  # whole seconds: 1.5 to 2.5 s from now
    for status, value, low, high in ((429, "2", 2.0, 2.0), (503, later, 1.4, 2.5), (502, "soon", 0.1, 0.1),
                                     (504, "0", 0.1, 0.1), (503, "-3", 0.1, 0.1)):
        attempts = retry.Attempts(10.0)
        pause = attempts.after(httpx.Response(status, headers={"Retry-After": value}), 1.0)
        assert pause is not None and low <= pause <= high and attempts.unsent() == "", (status, value, pause)
    for value, shown in (("30", "30 s"), ("9" * 400, "beyond any timeout")):  # past the timeout: not sent again
        attempts = retry.Attempts(10.0)
        assert attempts.after(httpx.Response(503, headers={"Retry-After": value}), 1.0) is None
        assert re.fullmatch(rf"Retry-After {shown}: more than the [0-9.]+ s left of the call's 10 s timeout, not "
                            "sent again", attempts.unsent()), attempts.unsent()
    assert retry.mendable(httpx.Response(429)) and not retry.mendable(httpx.Response(429), idempotent=False)


def test_an_https_url_to_the_plain_http_service_is_said_once_with_the_fix(base: str) -> None:
    """https:// to `eplb serve` (plain HTTP) was tried 3 times and said only '[SSL: WRONG_VERSION_NUMBER]': a failed
    TLS handshake is not sent again, and the line says to use http://."""
    url = base.replace("http://", "https://")
    with Client(url, api_key=KEY) as eplb, pytest.raises(Unreachable) as down:
        eplb.deployments()
    message = str(down.value)
    assert "WRONG_VERSION_NUMBER" in message and "attempt 2" not in message, message
    assert message.endswith("; eplb serve speaks plain HTTP: give the URL as http://, or put a TLS proxy in front"), \
        message
    assert retry.seconds(0.001) == "0.001" and retry.seconds(0.8997) == "0.9"  # a tiny timeout is not said as 0 s


def test_a_service_that_stays_down_is_tried_within_the_timeout_and_said_in_one_line(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused connection is sent again by the rule (it never reached the service, so even a call not safe to repeat
    is); after the last attempt, one line saying each attempt's outcome."""
    monkeypatch.setattr(retry, "BACKOFF_S", (0.01, 0.01))
    url = f"http://127.0.0.1:{_closed_port()}"
    sends: list[Callable[[Client], Any]] = [lambda eplb: eplb.deployments(),
                                            lambda eplb: eplb.delete_deployment("gone")]
    for send in sends:
        with Client(url) as eplb, pytest.raises(Unreachable) as down:
            send(eplb)
        message = str(down.value)
        assert message.startswith(f"cannot reach {url}: ") and "\n" not in message
        assert "(attempt 3, after unreachable (ConnectError: " in message and "(2 times))" in message, message
    assert retry.mendable(httpx.ConnectError("refused"), idempotent=False)
    assert not retry.mendable(httpx.ReadTimeout("late"), idempotent=False)
    assert not retry.mendable(httpx.Response(502), idempotent=False) and retry.mendable(httpx.Response(502))
    assert not retry.mendable(httpx.Response(500))


@pytest.mark.parametrize(("kwargs", "said"), [({"limit": True}, "limit must be a whole number (an int), got True"),
                                              ({"limit": 2.0}, "limit must be a whole number (an int), got 2.0"),
                                              ({"before": "7"}, "before must be a whole number (an int), got '7'")])
def test_history_refuses_a_page_bound_that_is_no_whole_number_before_sending(kwargs: dict[str, Any], said: str) -> None:
    """limit=True was sent as 'true' (the service's 422 named query.limit), 2.0 as '2.0'."""
    url = f"http://127.0.0.1:{_closed_port()}"
    with Client(url) as eplb, pytest.raises(InvalidRequest, match=f"^{re.escape(said)}$"):
        eplb.history("prod", **kwargs)
