"""GET /deployments/{name}?format=sglang|trtllm&layer_ids=...: an id of one of the preset's dense layers is a 422
naming query.layer_ids, not an export that puts a MoE layer's map on a dense layer (DeepSeek-V2-Lite's layer 0 is
dense: `layer_ids=0-3` exported the 4 MoE rows on layers 0..3, and layer 3's own map was SGLang's trivial one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eplb.store import open_store
from tests.test_deployments import LAYERS, config, window


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    from api.app import create_app
    from api.database import SqlJobStore
    from api.settings import Settings

    store = open_store(f"sqlite:///{tmp_path / 'eplb.db'}")
    settings = Settings(solver_workers=1)
    app = create_app(settings, job_store=SqlJobStore(store, settings.max_jobs, settings.job_ttl_s))
    app.state.db = store
    with TestClient(app, raise_server_exceptions=False) as c:
        body = config(threshold=1.1).model_dump(mode="json", exclude_none=True)
        assert c.put("/deployments/web", json=body).status_code == 201
        assert c.post("/deployments/web/windows", json={"loads": window(0)}).status_code == 200
        yield c
    store.close()


@pytest.mark.parametrize("fmt", ["sglang", "trtllm"])
@pytest.mark.parametrize("ids", [f"0-{LAYERS - 1}", f"2,0,{','.join(map(str, range(3, LAYERS + 1)))}"])
def test_a_dense_layer_id_is_a_422_naming_layer_ids(client: TestClient, fmt: str, ids: str) -> None:
    r = client.get("/deployments/web", params={"format": fmt, "layer_ids": ids})
    assert r.status_code == 422, r.text
    message = "layer 0 is dense: model 'deepseek-v2-lite' has 1 dense layer (0) before its MoE layers 1-26"
    assert r.json()["errors"] == [{"field": "query.layer_ids", "message": message}], r.json()


@pytest.mark.parametrize("fmt", ["sglang", "trtllm"])
def test_moe_layer_ids_export(client: TestClient, fmt: str) -> None:
    r = client.get("/deployments/web", params={"format": fmt, "layer_ids": f"1-{LAYERS}"})
    assert r.status_code == 200, r.text
    rows = r.json()["physical_to_logical_map"] if fmt == "sglang" else r.json()["initial_global_assignments"]
    assert len(rows) == 27 if fmt == "sglang" else sorted(rows, key=int) == [str(i) for i in range(1, LAYERS + 1)]
