"""The placement service against a real `eplb serve` on loopback, through httpx."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from eplb.evaluate import balance
from eplb.io.windows import read_window
from eplb.placement import Placement
from tests.conftest import free_port, poll_job, wait_until_ready
from tests.event_loop import healthz_while, loop_was_free

PROBLEM = "application/problem+json"
V3 = read_window(None).loads[:6]  # 6 real DeepSeek-V3 layers keep requests small


def request_body(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "deepseek-v3",
        "hardware": "h100",
        "cluster": {"num_gpus": 16, "num_redundant": 16},
        "loads": V3.tolist(),
        "tokens_per_gpu": 4096,
    }
    body.update(over)
    return body


@pytest.fixture(scope="module")
def base(server_factory: Callable[..., str]) -> str:
    return server_factory()


def test_greedy_placement_is_valid_and_predicted(base: str) -> None:
    r = httpx.post(f"{base}/placement", json=request_body(), timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    placement = Placement.from_dict(data["placement"])
    assert placement.slots_per_gpu.tolist() == [17] * 16
    lb = balance(V3, placement).lb
    assert data["predicted"]["lb"] == pytest.approx(lb.tolist(), abs=1e-6)
    assert data["predicted"]["baseline"]["lb_max"] > data["predicted"]["lb_max"]
    assert len(data["predicted"]["time_us"]) == 6 and len(data["predicted"]["baseline"]["time_us"]) == 6
    assert data["solver"]["name"] == "greedy" and data["solver"]["wall_ms"] > 0
    assert all(b <= v + 1e-9 for b, v in zip(data["solver"]["bound"], lb, strict=True))


def test_current_placement_reports_moves(base: str) -> None:
    first = httpx.post(f"{base}/placement", json=request_body(), timeout=60).json()
    shifted = np.roll(V3, 7, axis=1)
    r = httpx.post(f"{base}/placement", json=request_body(loads=shifted.tolist(),
                   current_placement=first["placement"]), timeout=60)
    assert r.status_code == 200, r.text
    moves = r.json()["moves"]
    assert len(moves["per_layer"]) == 6 and moves["total"] == sum(moves["per_layer"]) > 0
    assert moves["bytes_moved"] == pytest.approx(moves["total"] * 3 * 7168 * 2048)  # FP8 V3 expert
    same = httpx.post(f"{base}/placement", json=request_body(current_placement=first["placement"]), timeout=60)
    assert same.json()["moves"]["total"] == 0  # same window, same answer: nothing to copy


def test_evaluate_agrees_with_placement(base: str) -> None:
    solved = httpx.post(f"{base}/placement", json=request_body(), timeout=60).json()
    r = httpx.post(f"{base}/evaluate", json={"model": "deepseek-v3", "hardware": "h100", "tokens_per_gpu": 4096,
                                             "placement": solved["placement"], "loads": V3.tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["predicted"]["lb"] == solved["predicted"]["lb"]
    assert r.json()["predicted"]["time_us"] == solved["predicted"]["time_us"]


def test_a_window_of_subnormal_loads_is_timed_as_its_ratios_are(base: str) -> None:
    """Loads of 1e-320 (finite, >= 0: counts the library takes) overflowed the cost model's scaling: /placement and
    /evaluate answered time_us [null], a cost-trigger deployment's window a text/plain 500 (ValueError in
    choose_candidate), a forced window of a threshold deployment a 500 (comm_us None). Each now costs what the
    same ratios at 1 token cost."""
    mixtral = {"model": "mixtral-8x7b", "hardware": "h100", "cluster": {"num_gpus": 4}}
    tiny, one = [[1e-320] + [0.0] * 7], [[1.0] + [0.0] * 7]
    answers = [httpx.post(f"{base}/placement", json={**mixtral, "loads": w}, timeout=60) for w in (tiny, one)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    got, want = (a.json() for a in answers)
    assert got["predicted"] == want["predicted"] and got["predicted"]["time_us"][0] > 0
    evaluated = httpx.post(f"{base}/evaluate", json={"model": "mixtral-8x7b", "hardware": "h100", "loads": tiny,
                                                     "placement": got["placement"]}, timeout=60)  # fmt: skip
    assert evaluated.status_code == 200, evaluated.text
    assert evaluated.json()["predicted"]["time_us"] == want["predicted"]["time_us"]
    layers = [[1.0, 2, 3, 4, 5, 6, 7, 8]] * 32
    for trigger, second in (("cost", {"loads": tiny}), ("threshold", {"loads": tiny * 32, "force": True})):
        name = f"subnormal-{trigger}"
        put = httpx.put(f"{base}/deployments/{name}", json={**mixtral, "policy": {"trigger": trigger}}, timeout=60)
        assert put.status_code in (200, 201), put.text
        first = {"loads": layers[:1] if trigger == "cost" else layers}
        assert httpx.post(f"{base}/deployments/{name}/windows", json=first, timeout=60).status_code == 200
        r = httpx.post(f"{base}/deployments/{name}/windows", json=second, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["action"] == "rebalanced" and None not in r.json()["result"]["predicted"]["time_us"]


def test_async_job_flow_with_greedy(base: str) -> None:
    r = httpx.post(f"{base}/placement", json=request_body(**{"async": True}), timeout=60)
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    assert location.startswith("/jobs/") and r.json()["status"] in ("queued", "running")
    deadline = time.monotonic() + 60
    while True:
        job = httpx.get(f"{base}{location}", timeout=10).json()
        if job["status"] not in ("queued", "running") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert job["status"] == "done"
    sync = httpx.post(f"{base}/placement", json=request_body(), timeout=60).json()
    assert job["result"]["placement"] == sync["placement"]
    assert httpx.get(f"{base}/jobs/nope", timeout=10).status_code == 404


BAD = [
    ({"loads": [[1.0] * 255 + [float("nan")]] * 2}, "loads", "nan"),
    ({"loads": [[1.0] * 255 + [-3.0]]}, "loads", ">= 0"),
    ({"loads": [[1.0] * 256, [1.0] * 255]}, "loads", "ragged"),
    ({"loads": [[1.0] * 128]}, "loads", "model 'deepseek-v3' has 256"),
    ({"cluster": {"num_gpus": 16, "slots_per_gpu": 8}}, "cluster.slots_per_gpu", "cannot hold 256 experts"),
    ({"cluster": {"num_gpus": 16, "memory_budget_bytes": 1e9}}, "cluster.memory_budget_bytes", "fits no expert"),
    ({"model": "deepseek-v9"}, "model", "unknown preset"),
    ({"hardware": "tpu"}, "hardware", "unknown preset"),
    ({"cluster": {"num_gpus": 0}}, "cluster.num_gpus", "greater than or equal to 1"),
    ({"solver": "magic"}, "solver", "greedy"),
    ({"solver": "deepseek", "cluster": {"num_gpus": 16, "slots_per_gpu": [17] * 15 + [18]}}, "solver",
     "needs the same slot count on every GPU"),  # these three were 422s without errors
    ({"max_moves": 10}, "max_moves", "max_moves: a move budget needs the serving placement"),
    ({"target_lb": 1.05}, "target_lb",  # it was 'a move budget ... (give the current one)'
     "target_lb: a target lb needs the serving placement, whose edits it bounds: give it as current_placement"),
    ({"current_placement": {"phy2log": [list(range(256))] * 6, "slots_per_gpu": [16] * 16}}, "current_placement",
     "the current placement is for 16 GPUs, 16 slots each, the request asks for 16 GPUs, 17 slots each"),
]


@pytest.mark.parametrize(("over", "field", "text"), BAD, ids=[b[1] + "-" + b[2][:12] for b in BAD])
def test_errors_are_problem_details_naming_the_field(base: str, over: dict[str, Any], field: str, text: str) -> None:
    content = json.dumps(request_body(**over)).encode()  # json.dumps writes NaN as the client would
    r = httpx.post(f"{base}/placement", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["status"] == 422 and problem["title"] and text in problem["detail"]
    assert [e["field"] for e in problem["errors"]] == [field], problem


def test_body_limit_gives_413(server_factory: Callable[..., str]) -> None:
    small = server_factory(max_body_bytes="4096")
    r = httpx.post(f"{small}/placement", json=request_body(), timeout=60)
    assert r.status_code == 413 and r.headers["content-type"] == PROBLEM
    assert "4096 bytes" in r.json()["detail"]


def test_api_key(server_factory: Callable[..., str]) -> None:
    secured = server_factory(api_key="s3cret")
    assert httpx.get(f"{secured}/healthz", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(f"{secured}/placement", json=request_body(), headers=headers, timeout=60)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.headers["content-type"] == PROBLEM
    ok = httpx.post(f"{secured}/placement", json=request_body(), headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert ok.status_code == 200


def test_presets_health_docs(base: str) -> None:
    presets = httpx.get(f"{base}/presets", timeout=10).json()
    assert presets["models"]["deepseek-v3"]["num_experts"] == 256 and "h100" in presets["hardware"]
    assert httpx.get(f"{base}/healthz", timeout=10).json() == {"status": "ok"}
    assert httpx.post(f"{base}/placement", json=request_body(), timeout=60).status_code == 200
    ready = httpx.get(f"{base}/readyz", timeout=10).json()
    assert ready["status"] == "ready" and ready["lane"]["threads"] == 1
    assert ready["lane"]["ran_in_threads"] >= 1  # that greedy request ran in the server's lane thread
    assert "swagger" in httpx.get(f"{base}/docs", timeout=10).text.lower()
    schema = httpx.get(f"{base}/openapi.json", timeout=10).json()
    post = schema["paths"]["/placement"]["post"]
    assert PROBLEM in post["responses"]["422"]["content"] and PROBLEM in post["responses"]["503"]["content"]
    example = schema["components"]["schemas"]["PlacementRequest"]["examples"][0]
    assert httpx.post(f"{base}/placement", json=example, timeout=60).status_code == 200  # the docs' example works


def test_metrics_count_what_happened(server_factory: Callable[..., str]) -> None:
    fresh = server_factory(queue_limit="7")  # a server of its own: counts start at zero
    httpx.post(f"{fresh}/placement", json=request_body(), timeout=60)
    httpx.post(f"{fresh}/placement", json=request_body(), timeout=60)
    httpx.post(f"{fresh}/placement", json=request_body(model="nope"), timeout=60)
    text = httpx.get(f"{fresh}/metrics", timeout=10).text
    assert 'eplb_http_requests_total{method="POST",route="/placement",status="200"} 2.0' in text
    assert 'eplb_http_requests_total{method="POST",route="/placement",status="422"} 1.0' in text
    assert 'eplb_solve_duration_seconds_count{solver="greedy"} 2.0' in text
    assert 'eplb_last_placement_lb{solver="greedy",stat="max"}' in text


def test_metrics_count_the_solves_of_deployment_windows(server_factory: Callable[..., str]) -> None:
    """eplb_solve_duration_seconds counted POST /placement's solves only: a deployment's windows solved unseen."""
    fresh = server_factory(queue_limit="6")  # a server of its own: counts start at zero
    config = {"model": "deepseek-v3", "cluster": {"num_gpus": 16}, "policy": {"trigger": "periodic"}}
    assert httpx.put(f"{fresh}/deployments/counted", json=config, timeout=60).status_code == 201
    for shift, action in ((0, "placed"), (5, "rebalanced")):  # greedy places, incremental rebalances
        r = httpx.post(f"{fresh}/deployments/counted/windows", json={"loads": (V3 + shift).tolist()}, timeout=60)
        assert r.status_code == 200 and r.json()["action"] == action, r.text[:300]
    assert httpx.post(f"{fresh}/placement", json=request_body(), timeout=60).status_code == 200
    text = httpx.get(f"{fresh}/metrics", timeout=10).text
    assert 'eplb_solve_duration_seconds_count{solver="greedy"} 2.0' in text, text
    assert 'eplb_solve_duration_seconds_count{solver="incremental"} 1.0' in text, text
    assert 'eplb_last_placement_lb{solver="incremental",stat="max"}' in text


def test_milp_sync_respects_time_limit_and_beats_greedy(base: str) -> None:
    body = request_body(loads=V3[:4].tolist(), solver="milp", time_limit_s=2)
    started = time.monotonic()
    r = httpx.post(f"{base}/placement", json=body, timeout=60)
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["solver"]["wall_ms"] < 2000 * 1.25  # the solver keeps the request's budget
    assert elapsed < 2 + 8  # plus transport, parsing and a worker that may still be warming up (not the 30 s default)
    assert data["solver"]["name"] == "milp" and data["solver"]["status"] in ("optimal", "time_limit", "feasible")
    greedy = httpx.post(f"{base}/placement", json=request_body(loads=V3[:4].tolist()), timeout=60).json()
    assert all(m <= g + 1e-9 for m, g in zip(data["predicted"]["lb"], greedy["predicted"]["lb"], strict=True))
    Placement.from_dict(data["placement"])  # valid


def test_long_milp_becomes_a_job_and_can_be_cancelled(server_factory: Callable[..., str]) -> None:
    """One worker, no queue: a running job makes the next request 503; cancelling frees the worker."""
    tight = server_factory(solver_workers="1", queue_limit="0", async_threshold_s="5")
    body = request_body(loads=V3[:4].tolist(), solver="milp", time_limit_s=60)
    r = httpx.post(f"{tight}/placement", json=body, timeout=60)
    assert r.status_code == 202 and r.headers["location"].startswith("/jobs/")  # over the async threshold
    location = r.headers["location"]
    deadline = time.monotonic() + 30
    while httpx.get(f"{tight}{location}", timeout=10).json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    milp = request_body(loads=V3[:4].tolist(), solver="milp", time_limit_s=2)  # synchronous, for a solver process
    busy = httpx.post(f"{tight}/placement", json=milp, timeout=60)
    assert busy.status_code == 503 and busy.headers["retry-after"] and busy.headers["content-type"] == PROBLEM
    assert httpx.get(f"{tight}/readyz", timeout=10).status_code == 503
    greedy = httpx.post(f"{tight}/placement", json=request_body(), timeout=60)
    assert greedy.status_code == 200, greedy.text  # the in-process lane: no wait behind the running MILP
    cancelled = httpx.delete(f"{tight}{location}", timeout=10)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while (after := httpx.post(f"{tight}/placement", json=milp, timeout=60)).status_code == 503:
        assert time.monotonic() < deadline  # the replacement worker is starting
        time.sleep(0.2)
    assert after.status_code == 200
    assert httpx.get(f"{tight}{location}", timeout=10).json()["status"] == "cancelled"


# ----- hardening (issue 12, items 4-12) ----------------------------------------------------------------------


def test_finished_jobs_do_not_count_queued_are_queued_and_jobs_expire(server_factory: Callable[..., str]) -> None:
    base = server_factory(solver_workers="1", queue_limit="2", max_jobs="2", job_ttl_s="8", async_threshold_s="5")
    long = httpx.post(f"{base}/placement", json=request_body(loads=V3[:4].tolist(), solver="milp", time_limit_s=60),
                      timeout=60)
    assert long.status_code == 202
    first = long.headers["location"]
    poll_job(base, first, ("running",))
    waiting = httpx.post(f"{base}/placement", json=request_body(**{"async": True}), timeout=60)
    assert waiting.status_code == 202 and waiting.json()["status"] == "queued"
    second = waiting.headers["location"]
    assert httpx.get(f"{base}{second}", timeout=60).json()["status"] == "queued"  # not "running": no worker yet
    full = httpx.post(f"{base}/placement", json=request_body(**{"async": True}), timeout=60)
    assert full.status_code == 503 and "2 jobs are queued or running" in full.json()["detail"]
    assert httpx.delete(f"{base}{first}", timeout=60).json()["status"] == "cancelled"
    assert poll_job(base, second, ("done", "failed"))["status"] == "done"
    for _ in range(3):  # finished jobs no longer count against the cap
        r = httpx.post(f"{base}/placement", json=request_body(**{"async": True}), timeout=60)
        assert r.status_code == 202, r.text
        poll_job(base, r.headers["location"], ("done",))
    listed = httpx.get(f"{base}/jobs", timeout=60).json()
    assert listed["active"] == 0 and listed["max_jobs"] == 2 and len(listed["jobs"]) >= 3
    assert [j["status"] for j in listed["jobs"]][:3] == ["done"] * 3  # newest first
    assert all("result" not in j for j in listed["jobs"])
    assert listed["kept"] == len(listed["jobs"]) == 5  # the cancelled one, the one that waited, the 3 quick ones
    newest = httpx.get(f"{base}/jobs", params={"limit": 2}, timeout=60).json()  # 360k an hour at 100 jobs/s
    assert newest["jobs"] == listed["jobs"][:2] and newest["kept"] == 5
    for bad in (0, 1001, "x"):
        r = httpx.get(f"{base}/jobs", params={"limit": bad}, timeout=60)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "query.limit", r.text
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/jobs", timeout=60).json()["jobs"]:  # finished jobs expire after job_ttl_s (8 s: the
        # cancelled job must outlive the 4 solves after it on a loaded machine, where 3 s was too short)
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert httpx.get(f"{base}{second}", timeout=60).status_code == 404


def test_api_key_is_checked_before_the_body_is_read(server_factory: Callable[..., str]) -> None:
    secured = server_factory(api_key="s3cret")
    host, port = secured.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = (f"POST /placement HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {26 * 2**20}\r\n\r\n").encode()
        sock.sendall(head + b"[" * 2**20)  # 1 MB of a 26 MB body: the answer must not wait for the rest
        answer = sock.recv(4096).decode("latin-1")
    assert answer.startswith("HTTP/1.1 401"), answer[:200]
    bad = httpx.post(f"{secured}/placement", content=b"{not json", headers={"content-type": "application/json"},
                     timeout=60)
    assert bad.status_code == 401
    assert httpx.get(f"{secured}/jobs", timeout=60).status_code == 401
    assert httpx.get(f"{secured}/jobs", headers={"Authorization": "Bearer s3cret"}, timeout=60).status_code == 200


def test_non_json_is_400_and_other_media_types_415(base: str) -> None:
    r = httpx.post(f"{base}/placement", content=b'{"loads": [[1, 2,', headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.headers["content-type"] == PROBLEM
    assert "not valid JSON" in r.json()["detail"] and "errors" not in r.json()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/xml"):
        r = httpx.post(f"{base}/placement", content=json.dumps(request_body()).encode(),
                       headers={"content-type": content_type}, timeout=60)
        assert r.status_code == 415 and content_type in r.json()["detail"], r.text
    r = httpx.post(f"{base}/evaluate", content=b"nope", headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 400 and "npy" in r.json()["detail"]


def body_routes(base: str) -> list[tuple[str, str, set[str]]]:
    """(method, path with its parameters filled, content types) of every route the schema says takes a body."""
    schema = httpx.get(f"{base}/openapi.json", timeout=60).json()
    return [(method.upper(), path.replace("{name}", "x").replace("{job_id}", "x"), set(op["requestBody"]["content"]))
            for path, ops in schema["paths"].items() for method, op in ops.items() if "requestBody" in op]


def test_every_route_with_a_body_checks_its_type_and_parses_json_as_placement_does(base: str) -> None:
    """The /deployments routes answered a form or text body 422 'body: Input should be a valid dictionary', and a
    deeply nested body 400 'There was an error parsing the body', where POST /placement answers 415 naming the type
    and 'recursion limit exceeded'. One check and one parser for every route now; .npy only where it is taken."""
    routes = body_routes(base)
    assert {(m, p) for m, p, _ in routes} >= {("PUT", "/deployments/x"), ("POST", "/deployments/x/windows"),
                                              ("POST", "/deployments/x/placement"), ("POST", "/placement")}
    deep = httpx.post(f"{base}/placement", content=b"[" * 100_000, headers={"content-type": "application/json"},
                      timeout=60).json()
    broken = httpx.post(f"{base}/placement", content=b'{"loads": [[1, 2,', timeout=60).json()
    assert deep["title"] == "Body is not JSON" and "recursion limit exceeded" in deep["detail"], deep
    for method, path, types in routes:
        npy = "application/x-npy" in types
        others = ["text/plain", "application/x-www-form-urlencoded", "application/xml"]
        for content_type in others if npy else [*others, "application/x-npy"]:
            r = httpx.request(method, f"{base}{path}", content=b'{"loads": [[1.0]]}',
                              headers={"content-type": content_type}, timeout=60)
            assert r.status_code == 415 and r.headers["content-type"] == PROBLEM, (method, path, r.text)
            wanted = "application/json (or the loads as application/x-npy)" if npy else "application/json"
            assert r.json()["detail"] == f"send the request as {wanted}, not {content_type}", (method, path, r.text)
        for content, problem in ((b"[" * 100_000, deep), (b'{"loads": [[1, 2,', broken)):
            r = httpx.request(method, f"{base}{path}", content=content, headers={"content-type": "application/json"},
                              timeout=60)
            assert r.status_code == 400 and r.headers["content-type"] == PROBLEM, (method, path, r.text)
            assert {k: v for k, v in r.json().items() if k != "instance"} == {
                k: v for k, v in problem.items() if k != "instance"}, (method, path, r.text)
    no_type = httpx.request("PUT", f"{base}/deployments/untyped", content=json.dumps(
        {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4}}).encode(), timeout=60)
    assert no_type.status_code == 201, no_type.text  # no Content-Type is JSON, as at POST /placement


def test_every_get_route_answers_head(base: str) -> None:
    """HEAD /deployments/prod was a 405 although GET answers: FastAPI's routes answer only the methods they
    declare. Every GET route of the schema (and the docs) answers HEAD as its GET, without the body."""
    assert httpx.put(f"{base}/deployments/prod", json={"model": "mixtral-8x7b", "cluster": {"num_gpus": 4}},
                     timeout=60).status_code in (200, 201)
    schema = httpx.get(f"{base}/openapi.json", timeout=60).json()
    paths = [path.replace("{name}", "prod").replace("{job_id}", "no-such-job")
             for path, ops in schema["paths"].items() if "get" in ops]
    assert {"/deployments/prod", "/deployments", "/jobs", "/healthz"} <= set(paths)
    for path in [*paths, "/docs", "/openapi.json", "/deployments/nobody"]:
        got, head = httpx.get(f"{base}{path}", timeout=60), httpx.head(f"{base}{path}", timeout=60)
        assert head.status_code == got.status_code != 405 and head.content == b"", (path, head, got)
        assert head.headers["content-type"] == got.headers["content-type"], path
        if path not in ("/metrics", "/readyz"):  # these count the requests themselves
            assert head.headers.get("content-length") == got.headers.get("content-length"), path
    posted = httpx.head(f"{base}/placement", timeout=60)  # no GET there: no HEAD either
    assert posted.status_code == 405 and posted.headers["allow"] == "POST", posted.headers
    assert httpx.put(f"{base}/jobs/x", timeout=60).headers["allow"] == "GET, HEAD, DELETE"


LOOSE = [
    ({"time_limit": 5}, "time_limit"),
    ({"async": "yes"}, "async"),
    ({"loads": [["1.0"] * 256]}, "loads"),  # 'loads[0][0] is "1.0": loads are ...', one error for the array
    ({"loads": [[True] + [1.0] * 255]}, "loads"),
    ({"cluster": {"num_gpus": "4"}}, "cluster.num_gpus"),
    ({"cluster": {"num_gpus": 4, "slots": 80}}, "cluster.slots"),
    ({"overlap": 1}, "overlap"),
    ({"tokens_per_gpu": "4096"}, "tokens_per_gpu"),
    ({"cluster": {"num_gpus": 4.0}}, "cluster.num_gpus"),
    ({"current_placement": {"phy2log": [[0]], "slots_per_gpu": [1], "extra": 1}}, "current_placement.extra"),
]


@pytest.mark.parametrize(("over", "field"), LOOSE, ids=[f for _, f in LOOSE])
def test_unknown_fields_and_loose_types_are_refused(base: str, over: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{base}/placement", json=request_body(**over), timeout=60)
    assert r.status_code == 422, r.text
    assert any(e["field"].startswith(field) for e in r.json()["errors"]), r.json()


OVERFLOW = [
    ({"cluster": {"num_gpus": 16, "memory_budget_bytes": 1e300}}, "cluster.memory_budget_bytes"),
    ({"cluster": {"num_gpus": 16, "slots_per_gpu": 10**30}}, "cluster.slots_per_gpu"),
    ({"tokens_per_gpu": 1e300}, "tokens_per_gpu"),
    ({"link": "1e300"}, "link"),
    ({"cluster": {"num_gpus": 16, "num_redundant": 10**20}}, "cluster.num_redundant"),
    ({"time_limit_s": 1e300, "solver": "milp"}, "time_limit_s"),
]


@pytest.mark.parametrize(("over", "field"), OVERFLOW, ids=[f for _, f in OVERFLOW])
def test_every_number_is_bounded(base: str, over: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{base}/placement", json=request_body(**over), timeout=60)
    assert r.status_code == 422, r.text
    problem = r.json()
    assert any(e["field"].startswith(field) for e in problem["errors"]), problem
    assert len(problem["detail"]) < 300 and "\n" not in problem["detail"]


def test_docs_example_without_model_follows_the_windows_expert_count(base: str) -> None:
    schema = httpx.get(f"{base}/openapi.json", timeout=60).json()
    example = dict(schema["components"]["schemas"]["PlacementRequest"]["examples"][0])
    del example["model"]  # 8 experts: the Mixtral preset, as `eplb solve` infers it
    r = httpx.post(f"{base}/placement", json=example, timeout=60)
    assert r.status_code == 200, r.text
    with_model = httpx.post(f"{base}/placement", json={**example, "model": "mixtral-8x7b"}, timeout=60).json()
    assert r.json()["predicted"]["time_us"] == with_model["predicted"]["time_us"]
    odd = httpx.post(f"{base}/placement", json={"cluster": {"num_gpus": 2}, "loads": [[3, 1, 2]]}, timeout=60)
    assert odd.status_code == 200, odd.text  # no preset has 3 experts: a placement without a time prediction
    assert "time_us" not in odd.json()["predicted"]
    budget = httpx.post(f"{base}/placement", json={"cluster": {"num_gpus": 2, "memory_budget_bytes": 1e9},
                                                   "loads": [[3, 1, 2]]}, timeout=60)
    assert budget.status_code == 422 and budget.json()["errors"][0]["field"] == "model"


def test_openapi_security_405_allow_and_413_metrics(server_factory: Callable[..., str]) -> None:
    small = server_factory(max_body_bytes="4096", api_key="k")
    schema = httpx.get(f"{small}/openapi.json", timeout=60).json()
    assert schema["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "the service's API key (EPLB_API_KEY), when it has one"}
    assert schema["paths"]["/placement"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]
    r = httpx.put(f"{small}/jobs/abc", headers={"Authorization": "Bearer k"}, timeout=60)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "DELETE"}
    big = httpx.post(f"{small}/placement", json=request_body(), headers={"Authorization": "Bearer k"}, timeout=60)
    assert big.status_code == 413
    httpx.post(f"{small}/placement", json=request_body(), timeout=60)  # 401
    text = httpx.get(f"{small}/metrics", timeout=60).text
    assert 'eplb_http_requests_total{method="POST",route="/placement",status="413"} 1.0' in text
    assert 'eplb_http_requests_total{method="POST",route="/placement",status="401"} 1.0' in text


def server_children(base: str) -> list[int]:
    """Solver worker pids of the `eplb serve` listening at `base` (found through /proc)."""
    port = base.rsplit(":", 1)[1]
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            procs[int(entry)] = (ppid, [c.decode() for c in cmd])
    server = next(pid for pid, (_, cmd) in procs.items() if "serve" in cmd and port in cmd)
    return [pid for pid, (ppid, cmd) in procs.items() if ppid == server and any("spawn_main" in c for c in cmd)]


def test_a_worker_killed_while_idle_costs_no_request(server_factory: Callable[..., str]) -> None:
    base = server_factory(solver_workers="1", queue_limit="4", inline_solvers="")  # every request in the processes
    assert httpx.post(f"{base}/placement", json=request_body(), timeout=60).status_code == 200
    workers = server_children(base)
    assert len(workers) == 2  # the solver and the parser
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    r = httpx.post(f"{base}/placement", json=request_body(), timeout=60)
    assert r.status_code == 200, r.text  # retried on the replacement worker
    assert server_children(base) != workers


def zipf_window(layers: int, experts: int, seed: int = 0) -> list[list[float]]:
    """[layers][experts] tokens, each layer's expert popularity a power law (exponent 1.2) over its own ranking."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(experts) for _ in range(layers)])
    window: list[list[float]] = np.floor(1e6 / (1.0 + ranks) ** 1.2).tolist()
    return window


def test_a_large_solve_never_holds_the_fast_lane(server_factory: Callable[..., str]) -> None:
    """A 5 KB body can ask for seconds of greedy work (one layer of 256 experts on 4,096 GPUs of 16 slots: 2.7e8
    layers x slots x GPUs, about 2.5 s here): three of them took the lane thread and both idle solver processes, and
    the docs' small example waited behind them for seconds. A solve above EPLB_INLINE_MAX_WORK now runs in the solver
    processes only: the lane thread stays free for small requests."""
    base = server_factory(solver_workers="2", queue_limit="8", inline_threads="1")
    big = {"loads": zipf_window(1, 256), "cluster": {"num_gpus": 4096, "slots_per_gpu": 16}}
    small = {"model": "mixtral-8x7b", "hardware": "h100", "cluster": {"num_gpus": 4, "num_redundant": 4},
             "loads": [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]], "tokens_per_gpu": 256}
    assert httpx.post(f"{base}/placement", json=small, timeout=60).status_code == 200
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(
        httpx.post(f"{base}/placement", json=big, timeout=120).status_code)) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/readyz", timeout=10).json()["running"] < 2:  # both solver processes took a big one
        assert time.monotonic() < deadline
        time.sleep(0.05)
    lane = httpx.get(f"{base}/readyz", timeout=10).json()["lane"]
    started = time.monotonic()
    assert httpx.post(f"{base}/placement", json=small, timeout=60).status_code == 200
    waited = time.monotonic() - started
    for t in threads:
        t.join()
    assert lane["running"] == 0, lane  # a big one held the lane thread
    assert waited < 1.5, waited  # was the length of a big solve
    assert answers == [200, 200, 200]


def test_a_solve_beyond_the_services_work_bound_is_refused_naming_its_fields(base: str) -> None:
    """Nothing capped a solver without a time limit: one layer of 2,048 experts on 4,096 GPUs of 128 slots (a 10 KB
    body) took 10.8 s of greedy. Above eplb.rules.SERVICE_MAX_WORK layers x slots x GPUs (2**30), or
    SERVICE_MAX_LAYER_SLOTS layers x slots, a request is a 422 naming the loads and the cluster's fields, before
    anything is solved or queued; so is a deployment's config, and its window."""
    layer = list(range(1, 2049))
    for over, sizes in (({"cluster": {"num_gpus": 4096, "slots_per_gpu": 128}}, "1 layer x 524,288 slots x 4,096 "
                         "GPUs is 2,147,483,648, above the service's 1,073,741,824"),
                        ({"cluster": {"num_gpus": 1024, "slots_per_gpu": 512}, "loads": [layer] * 16},
                         "16 layers x 524,288 slots is 8,388,608 slots to place, above the service's 4,194,304"),
                        ({"cluster": {"num_gpus": 4, "slots_per_gpu": 3}, "loads": [[1] * 8] * 16_385},
                         "16,385 layers is above the service's 16,384 per solve")):  # 200,000 held a worker 30.8 s
        for run_async in (False, True):
            r = httpx.post(f"{base}/placement", json={"loads": [layer], **over, "async": run_async}, timeout=60)
            assert r.status_code == 422, r.text[:300]
            assert sizes in r.json()["detail"]
            fields = [e["field"] for e in r.json()["errors"]]
            assert fields == ["loads", "cluster.num_gpus", "cluster.slots_per_gpu"]
    wide = [list(range(1, 4098))]  # one layer of 4,097 experts: 16,785,409 pairs held densely, about 0.9 GB
    r = httpx.post(f"{base}/placement", json={"loads": wide, "cluster": {"num_gpus": 8}, "solver": "greedy-coact",
                                              "coactivation": "AAAA"}, timeout=60)  # judged before it is read
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "coactivation", r.text[:300]
    assert "1 layer x 4,097^2 experts is 16,785,409 expert pairs, above the 16,777,216" in r.json()["detail"]
    deepseek: dict[str, Any] = {"model": "deepseek-v3", "cluster": {"num_gpus": 4096, "slots_per_gpu": 128}}
    put = httpx.put(f"{base}/deployments/too-large", json=deepseek, timeout=60)
    assert put.status_code == 422 and [e["field"] for e in put.json()["errors"]] == [
        "cluster.num_gpus", "cluster.slots_per_gpu"], put.text[:300]
    deepseek["cluster"]["slots_per_gpu"] = 64  # one layer fits: 2**30
    assert httpx.put(f"{base}/deployments/too-large", json=deepseek, timeout=60).status_code in (200, 201)
    r = httpx.post(f"{base}/deployments/too-large/windows", json={"loads": zipf_window(2, 256)}, timeout=60)
    assert r.status_code == 422 and "2 layers x 262,144 slots x 4,096 GPUs" in r.json()["detail"], r.text[:300]
    assert [e["field"] for e in r.json()["errors"]] == ["loads", "cluster.num_gpus", "cluster.slots_per_gpu"]


def test_parsing_a_large_body_leaves_healthz_free(base: str) -> None:
    rows = np.tile(V3, (400, 1))  # 2,400 layers x 256 experts, about 12 MB of JSON
    rows[-1, -1] = -1.0  # parsed and validated in full, then refused: the cost is the parsing
    content = json.dumps(request_body(loads=rows.tolist())).encode()
    r, worst, took = healthz_while(base, lambda: httpx.post(f"{base}/placement", content=content, timeout=120,
                                                      headers={"content-type": "application/json"}))
    assert r.status_code == 422 and "[2399][255] is -1" in r.json()["detail"]
    assert loop_was_free(worst, took), f"/healthz took {worst:.3f} s while a large body was parsed in {took:.3f} s"


def test_loads_as_npy(base: str) -> None:
    buffer = io.BytesIO()
    np.save(buffer, V3.astype(np.int64))
    fields = {k: v for k, v in request_body().items() if k != "loads"}
    r = httpx.post(f"{base}/placement", content=buffer.getvalue(), params={"request": json.dumps(fields)},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    same = httpx.post(f"{base}/placement", json=request_body(), timeout=60).json()
    assert r.json()["placement"] == same["placement"] and r.json()["predicted"] == same["predicted"]
    twice = httpx.post(f"{base}/placement", content=buffer.getvalue(), headers={"content-type": "application/x-npy"},
                       params={"request": json.dumps({**fields, "loads": [[1]]})}, timeout=60)
    assert twice.status_code == 422 and twice.json()["errors"][0]["field"] == "loads"
    repeated = httpx.post(f"{base}/placement", content=buffer.getvalue(), headers={"content-type": "application/x-npy"},
                          params=[("request", json.dumps(fields)), ("request", "{}")], timeout=60)  # the last one won
    once = "given 2 times: give the request's other fields once, as one JSON object"
    assert repeated.status_code == 422 and repeated.json()["errors"] == [{"field": "query.request", "message": once}]
    nan_fields = json.dumps({**fields, "tokens_per_gpu": float("nan")})  # NaN as json.dumps writes it
    nan_npy = httpx.post(f"{base}/placement", content=buffer.getvalue(), params={"request": nan_fields},
                         headers={"content-type": "application/x-npy"}, timeout=60)
    nan_json = httpx.post(f"{base}/placement", content=json.dumps(request_body(tokens_per_gpu=float("nan"))),
                          headers={"content-type": "application/json"}, timeout=60)
    assert nan_json.status_code == 422 and nan_json.json()["errors"][0]["field"] == "tokens_per_gpu", nan_json.text
    assert nan_npy.status_code == 422 and nan_npy.json()["errors"] == nan_json.json()["errors"], nan_npy.text
    cut = httpx.post(f"{base}/placement", content=buffer.getvalue(), params={"request": '{"cluster": '},
                     headers={"content-type": "application/x-npy"}, timeout=60)
    said = "the 'request' query parameter is not valid JSON: EOF while parsing a value at line 1 column 12"
    assert cut.status_code == 400 and cut.json()["detail"] == said, cut.text


def test_server_stop_leaks_no_semaphores() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eplb.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            env={**os.environ, "EPLB_SOLVER_WORKERS": "2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, proc)
        body = request_body(loads=V3[:2].tolist(), solver="milp", time_limit_s=1)  # the MILP starts its own pool
        assert httpx.post(f"{base}/placement", json=body, timeout=60).status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "leaked" not in out.decode(), out.decode()


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie no one reaped has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_solver_processes_die_with_a_killed_server(tmp_path: Path) -> None:
    """kill -9 of a server whose solver process ran a MILP job (time_limit_s 20) left that process running (ppid 1,
    80% CPU) until its solve finished, up to the 3,600 s a job may take; its idle parser process too, until its
    pipe closed. Every worker now dies with the server (PR_SET_PDEATHSIG, set by the worker at start)."""
    port = free_port()
    env = {**os.environ, "EPLB_DATA_DIR": str(tmp_path), "EPLB_SOLVER_WORKERS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eplb.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        wait_until_ready(base, proc)
        r = httpx.post(f"{base}/placement", json=request_body(solver="milp", time_limit_s=20, **{"async": True}),
                       timeout=60)  # fmt: skip
        assert r.status_code == 202, r.text
        poll_job(base, r.headers["location"], ("running",))
        time.sleep(1.0)  # the solve is under way
        workers = server_children(base)
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)  # the solver and the parser
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "solver processes outlived the killed server"
    finally:
        proc.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # what the test started, should it fail


def test_incremental_rebalance_with_a_move_budget_answers_with_its_plan(base: str) -> None:
    first = httpx.post(f"{base}/placement", json=request_body(), timeout=60).json()
    shifted = np.roll(V3, 7, axis=1)
    body = request_body(loads=shifted.tolist(), current_placement=first["placement"], max_moves=40, stage_gib=2)
    r = httpx.post(f"{base}/placement", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["solver"]["name"] == "incremental"  # the default with a current placement
    assert 0 < data["moves"]["total"] <= 40
    plan = data["plan"]
    copies = [c for stage in plan["stages"] for c in stage["copies"] if c["bytes"] > 0]
    assert plan["num_copies"] == len(copies) == data["moves"]["total"]
    assert all(stage["bytes"] <= 2 * 2**30 for stage in plan["stages"])
    fresh = httpx.post(f"{base}/placement", json={**body, "solver": "greedy", "max_moves": None}, timeout=60)
    assert fresh.status_code == 200, fresh.text
    assert fresh.json()["moves"]["total"] > data["moves"]["total"]
    refused = httpx.post(f"{base}/placement", json={**body, "solver": "greedy"}, timeout=60)
    assert refused.status_code == 422 and "max_moves" in refused.json()["detail"]
    solvers = httpx.get(f"{base}/presets", timeout=30).json()["solvers"]
    assert {"greedy", "milp", "incremental"} <= set(solvers)


def test_a_model_object_is_checked_by_the_one_spec_definition(base: str) -> None:
    """ModelSpec is the request's schema too: its rule reaches the client as one field error, without the noise
    of the preset-name branch of `str | ModelSpec`."""
    from eplb.specs import MODEL_PRESETS

    model = {**MODEL_PRESETS["mixtral-8x7b"].to_dict(), "top_k": 20}
    r = httpx.post(f"{base}/placement", json={"model": model, "cluster": {"num_gpus": 4}, "loads": [[1.0] * 8]},
                   timeout=60)
    assert r.status_code == 422
    assert r.json()["errors"] == [{"field": "model", "message": "top_k (20) must not exceed num_experts (8)"}]


def test_the_answer_built_without_the_models_is_byte_for_byte_theirs() -> None:
    """api.convert.answer_json writes the answer straight from the outcome (no pydantic models on the hot path):
    the bytes equal the models' dump, whatever the outcome carries (time prediction or none, moves and a plan,
    a bytes-less plan, a solver's own facts, hierarchy, no solver at all)."""
    import orjson

    from api.convert import answer_json
    from eplb.solve import Cluster, CostSetup, evaluate, solve
    from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
    from solvers.registry import Options

    cost = CostSetup(MODEL_PRESETS["deepseek-v3"], HARDWARE_PRESETS["h100"], 450e9, 4096.0)
    cluster = Cluster(np.full(16, 17))
    first = solve(V3, cluster, cost=cost)
    shifted = np.roll(V3, 7, axis=1)
    outcomes = [
        first,
        solve(np.array([[3.0, 1, 2]]), Cluster(np.full(2, 2))),
        solve(V3, cluster, solver="deepseek", cost=cost),
        solve(V3, Cluster(np.full(16, 17), 4, 8), cost=cost),
        solve(shifted, cluster, cost=cost, current=first.placement, options=Options(max_moves=40), stage_bytes=2**31),
        solve(shifted, cluster, current=first.placement),
        evaluate(V3, first.placement, cost),
    ]
    for outcome in outcomes:
        assert answer_json(outcome) == orjson.dumps(outcome.to_model().to_json_dict())


@pytest.mark.parametrize(("over", "fields", "text"), [
    ({"cluster": {"num_gpus": 4, "gpus_per_node": 3, "num_groups": 2}}, ["cluster.gpus_per_node"],
     "cluster.gpus_per_node: 4 GPUs do not split into nodes of 3"),
    ({"cluster": {"num_gpus": 4, "gpus_per_node": 2, "num_groups": 3}}, ["cluster.num_groups"],
     "cluster.num_groups: 8 experts do not split into 3 equal groups"),
    ({"cluster": {"num_gpus": 4}, "solver": "incremental"}, ["solver", "current_placement"],
     "solver 'incremental' rebalances a serving placement: give current_placement"),
    ({"cluster": {"num_gpus": 4}, "link": "nvlink+nic"}, ["link", "cluster.gpus_per_node"], "GPUs per node"),
    ({"cluster": {"num_gpus": 4}, "node_limit": 1}, ["node_limit", "cluster.gpus_per_node"], "GPUs per node"),
])
def test_cluster_and_solver_refusals_name_their_fields_before_any_job(
        base: str, over: dict[str, Any], fields: list[str], text: str) -> None:
    """Nodes or groups that do not divide, and the incremental solver without current_placement, were 422s with
    no `errors` (the solve's own text), and with "async": true a 202 whose job then failed; PUT /deployments/{name}
    names the cluster's fields. A '+' link without nodes named cluster.gpus_per_node here and link at PUT: both
    name both now."""
    for run_async in (False, True):
        body = {"model": "mixtral-8x7b", "loads": [[1, 2, 3, 4, 5, 6, 7, 8]], **over, "async": run_async}
        r = httpx.post(f"{base}/placement", json=body, timeout=60)
        assert r.status_code == 422, r.text
        assert text in r.json()["detail"] and [e["field"] for e in r.json()["errors"]] == fields
    if over.get("solver") is None:
        put = httpx.put(f"{base}/deployments/shape", json={k: v for k, v in body.items() if k not in (
            "loads", "async")}, timeout=60)  # fmt: skip
        assert put.status_code == 422 and [e["field"] for e in put.json()["errors"]] == fields, put.text


def test_two_links_within_and_between_nodes(base: str) -> None:
    """"link": "nvlink+nic" (DeepEP across nodes) needs cluster.gpus_per_node; with it, the predicted comm lies
    between every copy over NVLink and every copy over the NIC."""
    for run_async in (False, True):  # refused before a job is queued
        r = httpx.post(f"{base}/placement", json=request_body(link="nvlink+nic", **{"async": run_async}), timeout=60)
        assert r.status_code == 422, r.text
        assert "GPUs per node" in r.json()["detail"]
        assert [e["field"] for e in r.json()["errors"]] == ["link", "cluster.gpus_per_node"]  # as PUT names them
    total = {}
    for link in ("nvlink", "nvlink+nic", "nic"):
        cluster = {"num_gpus": 16, "num_redundant": 16, "gpus_per_node": 8}
        r = httpx.post(f"{base}/placement", json=request_body(link=link, cluster=cluster, tokens_per_gpu=256),
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        total[link] = sum(r.json()["predicted"]["comm_us"])
    assert total["nvlink"] < total["nvlink+nic"] < total["nic"]


def test_budgets_a_solver_cannot_honour_name_the_api_fields(base: str) -> None:
    """time_limit_s for a solver without a time limit, a stage_gib that holds no expert copy: 422 naming the field
    (not the solver's option name, nor the bytes; the CLI names its flags)."""
    small = V3[:2].tolist()
    greedy = httpx.post(f"{base}/placement", json=request_body(loads=small, time_limit_s=2), timeout=60).json()
    assert greedy["status"] == 422 and greedy["errors"][0]["field"] == "time_limit_s"
    assert "solver 'greedy' has no time limit" in greedy["detail"] and "total_time_limit_s" not in greedy["detail"]
    first = httpx.post(f"{base}/placement", json=request_body(loads=small), timeout=60).json()
    tiny = httpx.post(f"{base}/placement", json=request_body(loads=small, current_placement=first["placement"],
                                                             stage_gib=0.01), timeout=60).json()  # fmt: skip
    assert tiny["status"] == 422 and tiny["errors"][0]["field"] == "stage_gib"
    assert tiny["detail"] == "stage_gib: 0.01 GiB cannot hold one expert copy of deepseek-v3: give at least 0.0411"
    enough = request_body(loads=small, current_placement=first["placement"], stage_gib=0.0411)
    assert httpx.post(f"{base}/placement", json=enough, timeout=60).status_code == 200
