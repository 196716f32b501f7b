"""/metrics labels a request's method by the HTTP methods the service knows: any other token a client sends is
`other`, so random methods cannot grow the registry without bound (each new method was a new series of the counter
and 17 of the latency histogram, kept for the process's life)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient


@pytest.fixture
def client() -> Iterator[TestClient]:
    from api.app import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(solver_workers=1)), raise_server_exceptions=False) as c:
        yield c


def test_unknown_methods_share_one_label(client: TestClient) -> None:
    size = len(client.get("/metrics").text)
    for i in range(40):
        assert client.request(f"X{i}Z", "/presets").status_code == 405
        assert client.request(f"Y{i}Z", f"/nope{i}").status_code == 404
    text = client.get("/metrics").text
    assert "X0Z" not in text and "Y39Z" not in text
    assert 'eplb_http_requests_total{method="other",route="/presets",status="405"} 40.0' in text
    assert 'eplb_http_requests_total{method="other",route="unmatched",status="404"} 40.0' in text
    assert len(text) < size + 20_000  # a few series, not 80 methods' worth


def test_known_methods_keep_their_names(client: TestClient) -> None:
    client.get("/presets")
    client.head("/presets")
    client.delete("/presets")
    text = client.get("/metrics").text
    for method, status in (("GET", 200), ("HEAD", 200), ("DELETE", 405)):
        assert f'eplb_http_requests_total{{method="{method}",route="/presets",status="{status}"}} 1.0' in text
