"""The OpenAPI schema lists what every route with a body answers: the Gate's 413 and the route class's 415 reach the
deployment routes too (PUT /deployments/{name}, POST .../windows, POST .../placement), not only /placement."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from eplb.store import open_store


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    from api.app import create_app
    from api.database import SqlJobStore
    from api.settings import Settings

    store = open_store(f"sqlite:///{tmp_path / 'eplb.db'}")
    settings = Settings(solver_workers=1, max_body_bytes=1024)
    app = create_app(settings, job_store=SqlJobStore(store, settings.max_jobs, settings.job_ttl_s))
    app.state.db = store
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    store.close()


def _body_operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in schema["paths"].items() for method, op in ops.items()
            if "requestBody" in op]


def test_every_route_with_a_body_documents_the_413_and_415_it_answers(client: TestClient) -> None:
    operations = _body_operations(client.get("/openapi.json").json())
    assert {(m, p) for m, p, _ in operations} >= {("PUT", "/deployments/{name}"),
                                                   ("POST", "/deployments/{name}/windows"),
                                                   ("POST", "/deployments/{name}/placement")}
    for method, path, op in operations:
        url = path.replace("{name}", "web")
        wrong = client.request(method, url, content=b"a,b", headers={"content-type": "text/csv"})
        big = client.request(method, url, content=b"[" + b"1," * 1024 + b"1]",
                             headers={"content-type": "application/json"})
        assert (wrong.status_code, big.status_code) == (415, 413), (method, path, wrong.text, big.text)
        for status in ("413", "415"):
            assert status in op["responses"], (method, path, status)
            assert "application/problem+json" in op["responses"][status]["content"], (method, path, status)
        types = set(op["requestBody"]["content"])
        described = op["responses"]["415"]["description"]
        # the 415's description names the types the route takes, and no other
        assert all(t in described for t in types), (method, path, described)
        assert ("application/x-npy" in described) == ("application/x-npy" in types), (method, path, described)
        unread = op["responses"]["400"]["description"]  # a body that does not parse: of the types taken
        assert (".npy" in unread) == ("application/x-npy" in types), (method, path, unread)
