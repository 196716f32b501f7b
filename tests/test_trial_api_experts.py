"""A placement whose `num_experts` is not the window's expert count, sent to /evaluate or as /placement's
current_placement, is a 422 naming `<field>.num_experts` and both counts: /evaluate answered a 422 with no `errors`
(for 7 of 8 experts) and both routes blamed a missing replica of expert 8 for 9 of 8, never saying the counts
differ."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

LOADS = [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from api.app import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(solver_workers=1)), raise_server_exceptions=False) as c:
        yield c


def _placement(experts: int) -> dict[str, Any]:
    rows = [[e % experts for e in range(8)]] * 2  # every one of `experts` ids in 8 slots
    return {"phy2log": rows, "slots_per_gpu": [2, 2, 2, 2], "num_experts": experts}


@pytest.mark.parametrize("experts", [7, 9])
@pytest.mark.parametrize("route", ["/evaluate", "/placement"])
def test_a_placement_of_another_expert_count_is_a_422_naming_its_num_experts(client: TestClient, route: str,
                                                                             experts: int) -> None:
    field = "placement" if route == "/evaluate" else "current_placement"
    body: dict[str, Any] = {"loads": LOADS, field: _placement(experts)}
    if route == "/placement":
        body["cluster"] = {"num_gpus": 4, "slots_per_gpu": 2}
    r = client.post(route, json=body)
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["errors"] == [{"field": f"{field}.num_experts",
                                  "message": f"is {experts}, but the loads have 8 experts"}], problem
    assert problem["detail"] == f"{field}.num_experts: is {experts}, but the loads have 8 experts"


@pytest.mark.parametrize("route", ["/evaluate", "/placement"])
def test_a_placement_of_the_windows_expert_count_is_taken(client: TestClient, route: str) -> None:
    field = "placement" if route == "/evaluate" else "current_placement"
    body: dict[str, Any] = {"loads": LOADS, field: _placement(8)}
    if route == "/placement":
        body["cluster"] = {"num_gpus": 4, "slots_per_gpu": 2}
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["placement"]["num_experts"] == 8
