"""A 422 stays small whatever the body: a field name it echoes is clipped as every echoed value is (40 characters,
with its length), and `errors` lists at most `api.problems.MAX_ERRORS` fields, then one entry saying how many more.
An unknown key of 1 MB came back twice (2 MB), and 200,000 unknown keys as 200,000 errors (12 MB)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

LOADS = [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from api.app import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(solver_workers=1)), raise_server_exceptions=False) as c:
        yield c


def _post(client: TestClient, body: dict[str, object], path: str = "/placement") -> dict[str, object]:
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert len(r.content) < 10_000, len(r.content)
    answer: dict[str, object] = r.json()
    return answer


@pytest.mark.parametrize("path", ["/placement", "/deployments/web"])
def test_a_huge_unknown_key_is_echoed_clipped(client: TestClient, path: str) -> None:
    key = "k" * 1_000_000
    if path == "/placement":
        answer = _post(client, {key: 1, "cluster": {"num_gpus": 4}, "loads": LOADS})
    else:
        r = client.put(path, json={key: 1, "model": "mixtral-8x7b", "cluster": {"num_gpus": 4}})
        assert r.status_code == 422 and len(r.content) < 10_000, len(r.content)
        answer = r.json()
    shown = "k" * 39 + "\u2026 (1,000,000 characters)"
    assert answer["errors"] == [{"field": shown, "message": "Extra inputs are not permitted"}], answer
    assert answer["detail"] == f"{shown}: Extra inputs are not permitted"


def test_many_errors_are_listed_up_to_a_bound_then_counted(client: TestClient) -> None:
    from api.problems import MAX_ERRORS

    body = {**{f"x{i}": i for i in range(5000)}, "cluster": {"num_gpus": 4}, "loads": LOADS}
    answer = _post(client, body)
    errors = answer["errors"]
    assert isinstance(errors, list) and len(errors) == MAX_ERRORS + 1
    assert errors[:MAX_ERRORS] == [{"field": f"x{i}", "message": "Extra inputs are not permitted"}
                                   for i in range(MAX_ERRORS)]
    assert errors[-1] == {"field": "body", "message": f"and {5000 - MAX_ERRORS:,} more errors (the first "
                                                      f"{MAX_ERRORS} are listed)"}


def test_a_few_errors_are_all_listed(client: TestClient) -> None:
    answer = _post(client, {"cluster": {"num_gpus": 0, "gpus": 1}, "loads": LOADS, "time_limit": 3})
    assert {e["field"] for e in answer["errors"]} == {"cluster.num_gpus", "cluster.gpus", "time_limit"}  # type: ignore[attr-defined]
