"""The service on real databases (a SQLite file, then a throwaway PostgreSQL): integer inputs beyond what the
store (PostgreSQL's int4 ids) or numpy hold are a 422 naming the field, not a 500 or a silently wrapped
number; a PUT that changes the cluster shape says it dropped the serving placement."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from eplb.store import Store, open_store
from tests.db_fixtures import db_url_fixture, postgres_fixture  # noqa: F401
from tests.test_deployments import config, window

PROBLEM = "application/problem+json"


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    from api.app import create_app
    from api.database import SqlJobStore
    from api.settings import Settings

    store: Store = open_store(db_url)
    settings = Settings(solver_workers=1)
    app = create_app(settings, job_store=SqlJobStore(store, settings.max_jobs, settings.job_ttl_s))
    app.state.db = store
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    store.close()


def register(client: TestClient, name: str = "web") -> None:
    body = config(threshold=1.1).model_dump(mode="json", exclude_none=True)
    assert client.put(f"/deployments/{name}", json=body).status_code == 201


@pytest.mark.parametrize("query", [{"before": "99999999999999999999999"}, {"before": str(2**31)},
                                   {"before": "0"}, {"limit": "99999999999999999999999"}, {"limit": "0"}])
def test_history_bounds_are_422(client: TestClient, query: dict[str, str]) -> None:
    register(client)
    r = client.get("/deployments/web/history", params=query)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    assert r.json()["errors"][0]["field"] == f"query.{next(iter(query))}"


def test_history_before_at_the_bound_pages_from_the_newest(client: TestClient) -> None:
    register(client)
    client.post("/deployments/web/windows", json={"loads": window(0)})
    client.post("/deployments/web/windows", json={"loads": window(1)})
    newest = client.get("/deployments/web/history").json()["entries"]
    top = client.get("/deployments/web/history", params={"before": str(2**31 - 1)})
    assert top.status_code == 200 and top.json()["entries"] == newest and len(newest) == 2


def test_placement_expert_ids_out_of_range_are_422_not_wrapped(client: TestClient) -> None:
    register(client)
    placed = client.post("/deployments/web/windows", json={"loads": window(0)}).json()["result"]["placement"]
    huge = [[99999999999999999999999, *placed["phy2log"][0][1:]], *placed["phy2log"][1:]]
    r = client.post("/deployments/web/placement", json={"placement": {**placed, "phy2log": huge}})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"].startswith("placement.phy2log")
    assert "-9223372036854775808" not in r.text  # it was read as a wrapped int64 before


def test_put_that_changes_the_shape_says_it_dropped_the_placement(client: TestClient) -> None:
    register(client)
    client.post("/deployments/web/windows", json={"loads": window(0)})
    same = client.put("/deployments/web", json=config(threshold=1.3).model_dump(mode="json", exclude_none=True))
    assert same.status_code == 200 and same.json()["placement"] is not None
    assert "placement_dropped" not in same.json()
    body = config(threshold=1.3).model_dump(mode="json", exclude_none=True)
    body["cluster"] = {"num_gpus": 8, "slots_per_gpu": 9}
    changed = client.put("/deployments/web", json=body)
    assert changed.status_code == 200
    assert "placement" not in changed.json() and "no longer fits" in changed.json()["placement_dropped"]
    assert client.get("/deployments/web").json().get("placement") is None
    again = client.put("/deployments/web", json=body)  # nothing left to drop
    assert again.status_code == 200 and "placement_dropped" not in again.json()
    created = client.put("/deployments/new", json=body)
    assert created.status_code == 201 and "placement_dropped" not in created.json()
    placed = client.post("/deployments/web/windows", json={"loads": window(0)}).json()
    assert placed["action"] == "placed" and placed["result"]["placement"]["slots_per_gpu"] == [9] * 8
