"""The placement service against a real `eplb serve` on loopback, through httpx."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from eplb.evaluate import balance
from eplb.io.windows import read_window
from eplb.placement import Placement

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
    ({"cluster": {"num_gpus": 16, "slots_per_gpu": 8}}, "cluster", "cannot hold 256 experts"),
    ({"cluster": {"num_gpus": 16, "memory_budget_bytes": 1e9}}, "cluster", "fits no expert"),
    ({"model": "deepseek-v9"}, "model", "unknown preset"),
    ({"hardware": "tpu"}, "hardware", "unknown preset"),
    ({"cluster": {"num_gpus": 0}}, "cluster.num_gpus", "greater than or equal to 1"),
    ({"solver": "magic"}, "solver", "greedy"),
]


@pytest.mark.parametrize(("over", "field", "text"), BAD, ids=[b[1] + "-" + b[2][:12] for b in BAD])
def test_errors_are_problem_details_naming_the_field(base: str, over: dict[str, Any], field: str, text: str) -> None:
    content = json.dumps(request_body(**over)).encode()  # json.dumps writes NaN as the client would
    r = httpx.post(f"{base}/placement", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["status"] == 422 and problem["title"] and text in problem["detail"]
    assert any(e["field"] == field for e in problem["errors"]), problem


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
    assert httpx.get(f"{base}/readyz", timeout=10).json()["status"] == "ready"
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


def test_milp_sync_respects_time_limit_and_beats_greedy(base: str) -> None:
    body = request_body(loads=V3[:4].tolist(), solver="milp", time_limit_s=2)
    started = time.monotonic()
    r = httpx.post(f"{base}/placement", json=body, timeout=60)
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    data = r.json()
    assert elapsed < 2 + 3  # the request's budget plus overhead
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
    busy = httpx.post(f"{tight}/placement", json=request_body(), timeout=60)
    assert busy.status_code == 503 and busy.headers["retry-after"] and busy.headers["content-type"] == PROBLEM
    assert httpx.get(f"{tight}/readyz", timeout=10).status_code == 503
    cancelled = httpx.delete(f"{tight}{location}", timeout=10)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while (after := httpx.post(f"{tight}/placement", json=request_body(), timeout=60)).status_code == 503:
        assert time.monotonic() < deadline  # the replacement worker is starting
        time.sleep(0.2)
    assert after.status_code == 200
    assert httpx.get(f"{tight}{location}", timeout=10).json()["status"] == "cancelled"
