"""How every route reads its body: one 400 for a body that is not JSON (an empty one too), whichever route."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def base(server_factory: Callable[..., str]) -> str:
    return server_factory()


def body_routes(base: str) -> list[tuple[str, str]]:
    """(method, path with its parameters filled) of every route the schema says takes a body."""
    schema = httpx.get(f"{base}/openapi.json", timeout=60).json()
    return [(method.upper(), path.replace("{name}", "x")) for path, ops in schema["paths"].items()
            for method, op in ops.items() if "requestBody" in op]


def test_an_empty_body_is_the_one_400_of_a_body_that_is_not_json_on_every_route(base: str) -> None:
    """PUT /deployments/x, POST /deployments/x/windows and /placement answered an empty body 422 'body: Field
    required' where /placement and /evaluate answer 400 'the body is not valid JSON: EOF ...' (docs/api.md: 400 for
    a body that is not JSON, one message from every route)."""
    created = httpx.put(f"{base}/deployments/x", json={"model": "mixtral-8x7b", "cluster": {"num_gpus": 4}},
                        timeout=60)
    assert created.status_code in (200, 201), created.text
    routes = body_routes(base)
    assert {("PUT", "/deployments/x"), ("POST", "/deployments/x/windows"), ("POST", "/deployments/x/placement"),
            ("POST", "/placement"), ("POST", "/evaluate")} <= set(routes)
    wanted = {"type": "about:blank", "title": "Body is not JSON", "status": 400,
              "detail": "the body is not valid JSON: EOF while parsing a value at line 1 column 0"}
    for method, path in routes:
        for headers in ({"content-type": "application/json"}, {}):
            r = httpx.request(method, f"{base}{path}", content=b"", headers=headers, timeout=60)
            assert r.status_code == 400 and r.headers["content-type"] == PROBLEM, (method, path, headers, r.text)
            assert r.json() == {**wanted, "instance": path}, (method, path, headers, r.text)
    assert httpx.get(f"{base}/deployments/x", timeout=60).json()["config"]["cluster"]["num_gpus"] == 4
