"""Careless and hostile request bodies against a real `eplb serve` on loopback: each a 4xx naming what is wrong,
never a 500 or a traceback."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from eplb.io.windows import read_window

PROBLEM = "application/problem+json"
NPY = {"content-type": "application/x-npy"}
V3 = read_window(None).loads[:4]
LAW = Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"
PREFILL = Path(__file__).resolve().parents[1] / "fixtures" / "sglang6017-dsv3-prefill-in4096.json"
FIELDS = {"model": "deepseek-v3", "hardware": "h100", "cluster": {"num_gpus": 16, "num_redundant": 16}}


@pytest.fixture(scope="module")
def base(server_factory: Callable[..., str]) -> str:
    return server_factory()


def lying_npy(shape: tuple[int, ...], descr: str = "<f8", data: bytes = b"\0" * 80) -> bytes:
    """A v1.0 .npy image whose header declares `shape` over only `data` (about 200 bytes in all)."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}".encode()
    header += b" " * (117 - len(header)) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def post_npy(base: str, route: str, content: bytes, fields: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}{route}", content=content, params={"request": json.dumps(fields)}, headers=NPY,
                      timeout=60)


def test_an_npy_body_whose_header_lies_is_400_not_500(base: str) -> None:
    """A ~200-byte body declaring (100000000, 100000) float64 was a 500 (numpy tried to allocate 72.8 TiB)."""
    solved = httpx.post(f"{base}/placement", json={**FIELDS, "loads": V3.tolist()}, timeout=60).json()
    lie = lying_npy((100_000_000, 100_000))
    assert len(lie) < 256
    for route, fields in (("/placement", FIELDS), ("/evaluate", {"model": "deepseek-v3",
                                                                  "placement": solved["placement"]})):
        r = post_npy(base, route, lie, fields)
        assert r.status_code == 400 and r.headers["content-type"] == PROBLEM, r.text
        assert r.json()["detail"] == ("the body is not a .npy array: its header declares shape [100000000, 100000] "
                                      "of float64 (80,000,000,000,000 bytes), but 80 bytes follow the header")
    short = post_npy(base, "/placement", npy(V3)[:-8], FIELDS)
    assert short.status_code == 400 and "but 8,184 bytes follow" in short.json()["detail"], short.text
    ok = post_npy(base, "/placement", npy(np.asfortranarray(V3.astype(">i4"))), FIELDS)
    assert ok.status_code == 200 and ok.json()["placement"] == solved["placement"], ok.text


def test_an_npy_body_of_noise_gets_our_one_line_400(base: str) -> None:
    """Not numpy's advice to pass allow_pickle."""
    noise = np.random.default_rng(0).bytes(300)
    r = post_npy(base, "/placement", noise, FIELDS)
    assert r.status_code == 400 and r.headers["content-type"] == PROBLEM, r.text
    detail = r.json()["detail"]
    assert detail.startswith("the body is not a .npy array: it does not start with numpy's magic string")
    assert "pickle" not in detail and "\n" not in detail
    header = post_npy(base, "/placement", b"\x93NUMPY\x01\x00\x05\x00{'a'", FIELDS)
    assert header.status_code == 400 and "its header is unreadable" in header.json()["detail"], header.text
    objects = io.BytesIO()
    np.save(objects, np.array([[1, None]], dtype=object), allow_pickle=True)
    pickled = post_npy(base, "/placement", objects.getvalue(), FIELDS)
    assert pickled.status_code == 400 and "dtype is object" in pickled.json()["detail"], pickled.text
    strings = post_npy(base, "/placement", npy(np.array([["a", "b"]])), FIELDS)
    assert strings.status_code == 422 and strings.json()["errors"][0]["field"] == "loads", strings.text


def test_a_coactivation_image_whose_header_lies_is_422_naming_the_field(base: str) -> None:
    """base64 of a zip whose tokens.npy claims 728 TiB: was a 500 (MemoryError)."""
    from eplb.coactivation import read_topk, summarize

    ids, _ = read_topk("fixtures/esft-dsv2lite-law-topk.npz")
    summary = summarize(ids, 64)
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(summary.to_bytes())) as source, \
            zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in source.namelist():
            lie = lying_npy((100_000_000, 1_000_000), "<i8")
            archive.writestr(name, lie if name == "tokens.npy" else source.read(name))
    loads = read_window("fixtures/esft-dsv2lite-law-topk.npz").loads
    body = {"model": "deepseek-v2-lite", "cluster": {"num_gpus": 8}, "loads": loads.tolist(),
            "coactivation": base64.b64encode(buffer.getvalue()).decode()}
    r = httpx.post(f"{base}/placement", json=body, timeout=60)
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text
    assert r.json()["errors"][0]["field"] == "coactivation"
    assert "tokens.npy is not a .npy array: its header declares shape [100000000, 1000000]" in r.json()["detail"]


@pytest.fixture(scope="module")
def solved_file(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What `eplb solve --loads fixtures/sglang6017-dsv3-prefill-in4096.json --out p32.json` writes: with
    `layer_ids` 3..60, the window's."""
    out = tmp_path_factory.mktemp("solved") / "p32.json"
    done = subprocess.run([sys.executable, "-m", "eplb.cli", "solve", "--loads", str(PREFILL), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    placement: dict[str, Any] = json.loads(out.read_text())
    assert placement["layer_ids"] == list(range(3, 61))
    return placement


def test_eplb_solve_out_files_are_taken_with_their_layer_ids(base: str, solved_file: dict[str, Any]) -> None:
    """current_placement (POST /placement), placement (POST /evaluate) and POST /deployments/X/placement took no
    layer_ids: 422 'Extra inputs are not permitted' for every file eplb solve --out writes from a fixture."""
    loads = read_window(PREFILL).loads.tolist()
    body = {"model": "deepseek-v3", "cluster": {"num_gpus": 32}, "loads": loads}
    r = httpx.post(f"{base}/placement", json={**body, "current_placement": solved_file}, timeout=60)
    assert r.status_code == 200 and r.json()["moves"]["total"] == 0, r.text
    r = httpx.post(f"{base}/evaluate", json={"model": "deepseek-v3", "loads": loads, "placement": solved_file},
                   timeout=60)
    assert r.status_code == 200, r.text
    config = {"model": "deepseek-v3", "hardware": "h100", "cluster": {"num_gpus": 32}}
    assert httpx.put(f"{base}/deployments/from-file", json=config, timeout=30).status_code in (200, 201)
    r = httpx.post(f"{base}/deployments/from-file/placement", json={"placement": solved_file}, timeout=60)
    assert r.status_code == 200 and r.json()["action"] == "applied", r.text
    # checked: one id per row, each row a different layer
    for ids, message in ((solved_file["layer_ids"][:-1], "57 ids for the placement's 58 layers"),
                         ([3, *solved_file["layer_ids"][:-1]], "layer 3 appears twice"),
                         ([*solved_file["layer_ids"][:-1], "60"], 'layer_ids[57] is "60": layer ids are whole')):
        bad = httpx.post(f"{base}/placement", json={**body, "current_placement": {**solved_file, "layer_ids": ids}},
                         timeout=60)
        assert bad.status_code == 422, bad.text
        assert bad.json()["errors"][0]["field"].startswith("current_placement.layer_ids"), bad.json()
        assert message in bad.json()["detail"], bad.json()


BODY = {**FIELDS, "loads": V3.tolist()}
CONFIG = {"model": "deepseek-v3", "hardware": "h100", "cluster": {"num_gpus": 16}}


def post_json(base: str, route: str, body: dict[str, Any], method: str = "POST") -> httpx.Response:
    """json.dumps writes NaN and Infinity as a careless client would."""
    return httpx.request(method, f"{base}{route}", content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"}, timeout=60)


def test_a_link_that_is_no_string_says_what_links_are(base: str) -> None:
    """"link": 400 was 'Input should be a valid string' (POST /placement and PUT /deployments alike)."""
    for route, sent, method in (("/placement", BODY, "POST"), ("/deployments/messages", CONFIG, "PUT")):
        r = post_json(base, route, {**sent, "link": 400}, method)
        assert r.status_code == 422 and r.json()["errors"] == [{"field": "link", "message": (
            'must be a string: nvlink, nic, pcie, or GB/s per GPU per direction such as "400"; or a link within and '
            "one between nodes, e.g. nvlink+nic")}], r.text


def test_a_nan_must_be_a_finite_number_and_one_or_per_gpu_fields_give_one_error(base: str) -> None:
    """NaN max_lb_slack was 'should be <= 1'; a NaN memory_budget_bytes two errors, one per member of 'one number
    or one per GPU' ('less than or equal to 1e15' and 'a valid array')."""
    for value in (float("nan"), float("inf")):
        r = post_json(base, "/placement", {**BODY, "max_lb_slack": value})
        assert r.status_code == 422, r.text
        assert r.json()["errors"] == [{"field": "max_lb_slack", "message": "Input should be a finite number"}]
    per_gpu = "cluster.memory_budget_bytes[1] is nan: budgets are numbers of bytes above 0 and at most 1e+15"
    for budget, message in ((float("nan"), "Input should be a finite number"),
                            ([1e9, float("nan")] + [1e9] * 14, per_gpu)):
        r = post_json(base, "/placement", {**BODY, "cluster": {"num_gpus": 16, "memory_budget_bytes": budget}})
        assert r.status_code == 422, r.text
        assert r.json()["errors"] == [{"field": "cluster.memory_budget_bytes", "message": message}]
    r = post_json(base, "/deployments/messages", {**CONFIG, "cluster": {"num_gpus": 16,
                                                                         "memory_budget_bytes": float("nan")}}, "PUT")
    assert r.status_code == 422 and [e["message"] for e in r.json()["errors"]] == ["Input should be a finite number"]
    r = post_json(base, "/placement", {**BODY, "cluster": {"num_gpus": 16, "slots_per_gpu": "17"}})
    assert r.json()["errors"] == [{"field": "cluster.slots_per_gpu",
                                   "message": "Input should be a valid integer or a valid array"}], r.text


def test_per_gpu_budgets_are_described_as_given(base: str) -> None:
    """GPU 0 holds 1.86 GiB, GPU 1 0.93: the message said 'a budget of 0.93 GiB per GPU'."""
    lite = {"model": "deepseek-v2-lite", "loads": [[1.0] * 64], "cluster": {"num_gpus": 2,
                                                                            "memory_budget_bytes": [2e9, 1e9]}}
    r = post_json(base, "/placement", lite)
    assert r.status_code == 422 and r.json()["detail"] == (
        "cluster.memory_budget_bytes: budgets of 0.93-1.86 GiB per GPU (2.79 GiB in all) fit 6 expert slots in all, "
        "fewer than the 64 experts; give at least 13.41 GiB per GPU (0.42 GiB per slot) or more GPUs"), r.text


def test_groups_without_nodes_are_refused_by_name(base: str) -> None:
    """cluster.num_groups without cluster.gpus_per_node was silently ignored."""
    groups = "needs cluster.gpus_per_node: the hierarchical policy keeps each group of experts within a node; give " \
             "both, or neither"
    r = post_json(base, "/placement", {**BODY, "cluster": {"num_gpus": 16, "num_groups": 8}})
    assert r.status_code == 422 and r.json()["errors"] == [{"field": "cluster.num_groups", "message": groups}], r.text
    r = post_json(base, "/deployments/messages", {**CONFIG, "cluster": {"num_gpus": 16, "num_groups": 8}}, "PUT")
    assert r.status_code == 422 and r.json()["errors"] == [{"field": "cluster.num_groups", "message": groups}], r.text
    hierarchical = {"num_gpus": 16, "num_groups": 8, "gpus_per_node": 8}
    assert post_json(base, "/placement", {**BODY, "cluster": hierarchical}).status_code == 200


def test_every_deployments_route_needs_the_key(server_factory: Callable[..., str]) -> None:
    """docs/api.md: with EPLB_API_KEY, every /deployments route (reads too: a cluster's config and history),
    GET /jobs and every write need it; a job's own id, presets, health and metrics do not."""
    secured = server_factory(api_key="s3cret")
    key = {"Authorization": "Bearer s3cret"}
    for path in ("/deployments", "/deployments/x", "/deployments/x/history", "/jobs"):
        assert httpx.get(f"{secured}{path}", timeout=30).status_code == 401, path
        assert httpx.get(f"{secured}{path}", headers=key, timeout=30).status_code in (200, 404), path
    for path in ("/jobs/nope", "/presets", "/healthz", "/metrics"):
        assert httpx.get(f"{secured}{path}", timeout=30).status_code in (200, 404), path


def test_a_hierarchical_cluster_the_solver_cannot_honour_names_the_fields(base: str) -> None:
    """POST /placement with groups a solver cannot keep within nodes was told to 'drop --groups/--gpus-per-node'
    (the CLI's flags), with no `errors`, and an async one became a job that failed; now a 422 naming the fields
    before anything is solved or queued, as PUT /deployments does."""
    from eplb.coactivation import read_topk, summarize

    ids, _ = read_topk(LAW)
    lite = {"model": "deepseek-v2-lite", "cluster": {"num_gpus": 8, "gpus_per_node": 4, "num_groups": 8},
            "loads": read_window(LAW).loads.tolist(), "solver": "greedy-coact",
            "coactivation": summarize(ids, 64).to_dict()}
    for run_async in (False, True):
        r = httpx.post(f"{base}/placement", json={**lite, "async": run_async}, timeout=60)
        assert r.status_code == 422, r.text
        problem = r.json()
        assert [e["field"] for e in problem["errors"]] == ["solver", "cluster.gpus_per_node", "cluster.num_groups"]
        assert "drop cluster.num_groups/cluster.gpus_per_node or choose one of greedy" in problem["detail"], problem
        assert "--" not in problem["detail"]
    first = httpx.post(f"{base}/placement", json=BODY, timeout=60).json()["placement"]  # no groups: a MILP rebalance
    groups = {"num_gpus": 16, "num_redundant": 16, "gpus_per_node": 8, "num_groups": 8}
    r = httpx.post(f"{base}/placement", json={**BODY, "cluster": groups, "current_placement": first, "solver": "milp",
                                               "time_limit_s": 2}, timeout=60)
    assert r.status_code == 422 and [e["field"] for e in r.json()["errors"]] == [  # the fields of every way out
        "solver", "cluster.gpus_per_node", "cluster.num_groups", "current_placement"], r.text
    assert r.json()["detail"].endswith(  # every way out: it offered dropping the groups only, not current_placement
        "solver 'milp' keeps expert groups within nodes or minimizes copies from a current placement, not both: drop "
        "cluster.num_groups/cluster.gpus_per_node or current_placement, or choose a solver that does both "
        "(incremental)"), r.text
    one = {**BODY, "loads": V3[:1].tolist()}  # each way out taken, on one layer
    serving = httpx.post(f"{base}/placement", json=one, timeout=60).json()["placement"]
    for way_out in ({"cluster": groups, "solver": "milp", "time_limit_s": 1},
                    {"current_placement": serving, "solver": "milp", "time_limit_s": 1},
                    {"cluster": groups, "current_placement": serving, "solver": "incremental"}):
        taken = httpx.post(f"{base}/placement", json={**one, **way_out}, timeout=60)
        assert taken.status_code == 200, (way_out.keys(), taken.text)
    r = post_json(base, "/deployments/milp-groups", {**CONFIG, "cluster": groups, "solver": "milp", "time_limit_s": 2},
                  "PUT")  # a deployment's every rebalance starts from the serving placement: no dropping it offered
    assert r.status_code == 422 and [e["field"] for e in r.json()["errors"]] == [
        "solver", "cluster.gpus_per_node", "cluster.num_groups"], r.text
    assert r.json()["detail"].endswith(
        "drop cluster.num_groups/cluster.gpus_per_node, or choose a solver that does both (incremental)"), r.text


BAD_CLUSTERS: list[tuple[dict[str, Any], str, str]] = [  # (fields over a 16-GPU cluster, the field named, its message)
    ({"num_gpus": 0}, "cluster.num_gpus", "Input should be greater than or equal to 1"),
    ({"num_gpus": 4097}, "cluster.num_gpus", "Input should be less than or equal to 4096"),
    ({"gpus_per_node": 0}, "cluster.gpus_per_node", "Input should be greater than or equal to 1"),
    ({"gpus_per_node": 8, "num_groups": 0}, "cluster.num_groups", "Input should be greater than or equal to 1"),
    ({"slots_per_gpu": 0}, "cluster.slots_per_gpu", "Input should be greater than or equal to 1"),
    ({"slots_per_gpu": [17] * 15 + [0]}, "cluster.slots_per_gpu",
     "cluster.slots_per_gpu[15] is 0: slot counts are whole numbers from 1 to 4,096"),
    ({"slots_per_gpu": 4097}, "cluster.slots_per_gpu", "Input should be less than or equal to 4096"),
    ({"slots_per_gpu": [17] * 4097}, "cluster.slots_per_gpu", "cluster.slots_per_gpu has 4,097 values: at most 4,096"),
    ({"slots_per_gpu": []}, "cluster.slots_per_gpu", "cluster.slots_per_gpu is empty: at least 1 value"),
    ({"slots_per_gpu": [17] * 15}, "cluster.slots_per_gpu", "got 15 values for 16 GPUs (give one, or one per GPU)"),
    ({"num_redundant": -1}, "cluster.num_redundant", "Input should be greater than or equal to 0"),
    ({"memory_budget_bytes": 0.0}, "cluster.memory_budget_bytes", "Input should be greater than 0"),
    ({"memory_budget_bytes": -1e9}, "cluster.memory_budget_bytes", "Input should be greater than 0"),
    ({"memory_budget_bytes": 2e15}, "cluster.memory_budget_bytes",
     "Input should be less than or equal to 1000000000000000"),
    ({"memory_budget_bytes": [1e11] * 3 + [0.0] + [1e11] * 12}, "cluster.memory_budget_bytes",
     "cluster.memory_budget_bytes[3] is 0.0: budgets are numbers of bytes above 0 and at most 1e+15"),
    ({"memory_budget_bytes": [1e11] * 4097}, "cluster.memory_budget_bytes",
     "cluster.memory_budget_bytes has 4,097 values: at most 4,096"),
    ({"memory_budget_bytes": [1e11] * 17}, "cluster.memory_budget_bytes",
     "got 17 values for 16 GPUs (give one, or one per GPU)"),
]


def test_a_bad_cluster_gets_one_422_from_post_placement_and_put_deployments(base: str) -> None:
    """The two cluster models had their own bounds: POST /placement took 0 slots and 0-byte budgets (refused
    later, naming `cluster`), PUT /deployments took per-GPU lists of any length (a 422 naming no field) and a list
    of the wrong length ('slots per GPU: got 15 values for 16 GPUs', no `errors`). One set of bounds now
    (`eplb.schemas.ClusterRules`): the same 422 from both, naming the field."""
    for over, field, message in BAD_CLUSTERS:
        cluster = {"num_gpus": 16, **over}
        placed = post_json(base, "/placement", {**BODY, "cluster": cluster})
        put = post_json(base, "/deployments/bad-cluster", {**CONFIG, "cluster": cluster}, "PUT")
        for r in (placed, put):
            assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, (over, r.text[:300])
            assert r.json()["errors"] == [{"field": field, "message": message}], (over, r.text[:300])
            named = message.startswith(field)  # a per-GPU list's message names its element: the whole detail
            assert r.json()["detail"] == (message if named else f"{field}: {message}"), (over, r.text[:300])
    assert httpx.get(f"{base}/deployments/bad-cluster", timeout=30).status_code == 404
    # one value in a list is one for every GPU; no budget, the same default from both
    good: list[dict[str, Any]] = [{"num_gpus": 16, "slots_per_gpu": [17]},
                                  {"num_gpus": 16, "memory_budget_bytes": [4.4e10]}, {"num_gpus": 16}]
    for cluster in good:
        placed = post_json(base, "/placement", {**BODY, "cluster": cluster})
        put = post_json(base, "/deployments/good-cluster", {**CONFIG, "cluster": cluster}, "PUT")
        assert placed.status_code == 200 and put.status_code == 201, (placed.text[:300], put.text[:300])
        window = post_json(base, "/deployments/good-cluster/windows", {"loads": V3.tolist()})
        assert window.status_code == 200 and window.json()["action"] == "placed", window.text[:300]
        slots = placed.json()["placement"]["slots_per_gpu"]
        assert slots == window.json()["result"]["placement"]["slots_per_gpu"] == [17] * 16, cluster
        assert httpx.delete(f"{base}/deployments/good-cluster", timeout=30).status_code == 204
    assert put.json()["config"]["cluster"]["num_redundant"] == 16  # the default, written out


def test_the_two_cluster_models_share_every_field_with_its_bounds_and_default() -> None:
    """POST /placement's cluster and a deployment's declare no field of their own: the base's, once."""
    from api.schemas import ClusterIn
    from eplb.deployments import ClusterShape
    from eplb.schemas import ClusterRules

    def fields(model: type[ClusterRules]) -> dict[str, tuple[object, ...]]:
        return {n: (repr(f.annotation), f.default, repr(f.metadata)) for n, f in model.model_fields.items()}

    assert fields(ClusterIn) == fields(ClusterShape) == fields(ClusterRules)
    assert set(fields(ClusterRules)) == {"num_gpus", "gpus_per_node", "num_groups", "slots_per_gpu", "num_redundant",
                                         "memory_budget_bytes"}
    assert ClusterIn.model_config == ClusterShape.model_config == {"extra": "forbid", "strict": True}


def test_a_weighted_split_the_request_cannot_have_names_the_json_fields(base: str) -> None:
    """The time objective with weighted shares was told to 'drop --split weighted' (the CLI's flag), with no
    `errors`, and an async one became a job that failed; a weighted split of a solver without one was told to 'use
    --solver milp'. Now a 422 naming the request's fields, before anything is solved or queued; a deployment whose
    every window's solve would refuse it is refused at PUT, naming its config's fields."""
    time_weighted = "the time objective places uniform shares: drop split weighted (solver 'milp-weighted')"
    named_weighted = ("the time objective places uniform shares, and solver 'milp-weighted' weights them: choose "
                      "another solver ('milp' places uniform ones)")
    cases = [
        ({"solver": "milp", "split": "weighted", "objective": "time"}, ["split", "objective"], time_weighted),
        ({"solver": "milp-weighted", "objective": "time"}, ["solver", "objective"], named_weighted),
        ({"solver": "greedy", "split": "weighted"}, ["solver", "split"],
         "the greedy solver gives uniform shares only; use solver milp for split weighted"),
        # a uniform split with the weighted MILP wrote weighted shares (the split defaulted to uniform unseen)
        ({"solver": "milp-weighted", "split": "uniform"}, ["solver", "split"],
         "solver milp-weighted gives replicas weighted shares, split uniform even ones: drop split uniform, or "
         "choose solver milp"),
    ]
    for over, fields, message in cases:
        for run_async in (False, True):
            r = post_json(base, "/placement", {**BODY, "time_limit_s": 2, **over, "async": run_async})
            assert r.status_code == 422, r.text
            problem = r.json()
            assert problem["errors"] == [{"field": field, "message": message} for field in fields], problem
            assert problem["detail"] == message and "--" not in problem["detail"]
    milp = post_json(base, "/placement", {**BODY, "loads": V3[:1].tolist(), "solver": "milp", "split": "weighted",
                                          "time_limit_s": 2})
    assert milp.status_code == 200 and milp.json()["solver"]["name"] == "milp-weighted", milp.text  # lb: weighted
    r = post_json(base, "/deployments/weighted", {**CONFIG, "solver": "milp-weighted", "objective": "time",
                                                  "time_limit_s": 2}, "PUT")
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": field, "message": named_weighted} for field in ("solver", "objective")]
    assert post_json(base, "/deployments/weighted", {**CONFIG, "solver": "milp-weighted", "time_limit_s": 2},
                     "PUT").status_code == 201
    assert httpx.delete(f"{base}/deployments/weighted", timeout=30).status_code == 204


def test_layer_ids_out_of_order_are_named_on_every_route_that_takes_a_placement(base: str) -> None:
    """layer_ids [5, 3] passed the schema (any order) and were refused later by the Placement (rows in increasing
    order), as a 422 naming the whole placement (`current_placement`, `placement`), not its layer_ids."""
    loads = [[120, 80, 5, 3, 60, 40, 33, 11], [40, 40, 60, 70, 10, 90, 5, 5]]
    shuffled = {"phy2log": [[0, 1, 2, 3, 4, 5, 6, 7]] * 2, "slots_per_gpu": [2, 2, 2, 2], "layer_ids": [5, 3]}
    cluster = {"num_gpus": 4, "slots_per_gpu": 2}
    config = {"model": "mixtral-8x7b", "hardware": "h100", "cluster": cluster}
    assert httpx.put(f"{base}/deployments/shuffled", json=config, timeout=30).status_code in (200, 201)
    for route, body, field in (
            ("/placement", {"loads": loads, "cluster": cluster, "current_placement": shuffled}, "current_placement"),
            ("/evaluate", {"loads": loads, "placement": shuffled}, "placement"),
            ("/deployments/shuffled/windows", {"loads": loads, "current_placement": shuffled}, "current_placement"),
            ("/deployments/shuffled/placement", {"placement": shuffled}, "placement")):
        bad = httpx.post(f"{base}{route}", json=body, timeout=60)
        assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM, (route, bad.text)
        assert [e["field"] for e in bad.json()["errors"]] == [f"{field}.layer_ids"], (route, bad.json())
        assert "layer 3 comes after layer 5" in bad.json()["detail"], (route, bad.json())
    assert httpx.get(f"{base}/deployments/shuffled/history", timeout=30).json()["entries"] == []


def test_unknown_preset_names_are_echoed_clipped_with_their_length(base: str) -> None:
    """A 100,000-character model name came back whole in detail and errors (a 200 KB 422); a deployment's
    200-character one (its cap) whole too. Every echo goes through eplb.errors.shown: 40 characters, then the
    length."""
    window = {"loads": V3.tolist(), "cluster": {"num_gpus": 16, "num_redundant": 16}}
    placed = httpx.post(f"{base}/placement", json={**FIELDS, **window}, timeout=60).json()["placement"]
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("/placement", "model", {**window, "model": "x" * 100_000}),
        ("/placement", "hardware", {**window, "hardware": "y" * 100_000}),
        ("/evaluate", "model", {"loads": V3.tolist(), "placement": placed, "model": "x" * 100_000}),
        ("/deployments/clipped", "model", {"model": "z" * 200, "cluster": {"num_gpus": 16, "slots_per_gpu": 17}}),
        ("/deployments/clipped", "hardware", {"model": "deepseek-v3", "hardware": "h" * 200,
                                              "cluster": {"num_gpus": 16, "slots_per_gpu": 17}}),
    ]
    for route, field, body in cases:
        r = (httpx.put if route.startswith("/deployments") else httpx.post)(f"{base}{route}", json=body, timeout=60)
        assert r.status_code == 422 and len(r.content) < 1000, (route, field, len(r.content))
        problem = r.json()
        name: str = body[field]
        assert f"unknown preset '{name[0] * 39}\u2026' ({len(name):,} characters); known: " in problem["detail"]
        assert problem["errors"] == [{"field": field, "message": problem["detail"].removeprefix(f"{field}: ")}]
    solver = {"model": "deepseek-v3", "solver": "s" * 100_000, "cluster": {"num_gpus": 16, "slots_per_gpu": 17}}
    r = httpx.put(f"{base}/deployments/clipped", json=solver, timeout=60)
    assert r.status_code == 422 and len(r.content) < 1000 and r.json()["errors"][0]["field"] == "solver", r.text[:300]


def test_an_option_the_solver_does_not_take_is_the_one_field_named_and_only_fields_are_offered(base: str) -> None:
    """milp with max_moves named time_limit_s (valid) beside max_moves, and offered total_time_limit_s, a field
    the API refuses as unknown: the registry's refusal names the refused options and offers the request's
    fields (api.convert.OPTION_FIELDS)."""
    import re

    from api.schemas import PlacementRequest

    window = {"loads": V3.tolist(), "cluster": {"num_gpus": 16, "num_redundant": 16}}
    current = httpx.post(f"{base}/placement", json={**FIELDS, **window}, timeout=60).json()["placement"]
    for extra, refused in (({"time_limit_s": 2}, ["max_moves"]), ({}, ["max_moves"]),
                           ({"target_lb": 1.1}, ["max_moves", "target_lb"])):
        body = {**FIELDS, **window, "solver": "milp", "max_moves": 2, "current_placement": current, **extra}
        problem = httpx.post(f"{base}/placement", json=body, timeout=60).json()
        assert [e["field"] for e in problem["errors"]] == refused, problem
        said = re.fullmatch(r"solver 'milp' does not take (.*) \(it takes: (.*)\)", problem["detail"])
        assert said is not None and said[1] == ", ".join(refused) and said[2] == "max_lb_slack, time_limit_s"
    body = {**FIELDS, **window, "solver": "incremental", "max_lb_slack": 0.2, "current_placement": current}
    problem = httpx.post(f"{base}/placement", json=body, timeout=60).json()
    assert [e["field"] for e in problem["errors"]] == ["max_lb_slack"], problem
    offered = problem["detail"].partition("(it takes: ")[2].rstrip(")").split(", ")
    assert offered == ["max_moves", "max_moves_per_layer", "target_lb"]
    assert set(offered) <= set(PlacementRequest.model_fields), offered


def test_options_with_no_effect_without_what_they_act_on_are_refused_naming_them(base: str) -> None:
    """stage_gib without current_placement (no plan to stage) and node_limit without coactivation (it caps only
    the summary's copies per token) were 200s that dropped them, where max_moves without current_placement is a
    422: each is a 422 naming it, before any job, on /placement and /evaluate alike; with what they act on, 200."""
    from eplb.coactivation import read_topk, summarize

    ids, _ = read_topk(LAW)
    loads = read_window(LAW).loads
    setup = {"model": "deepseek-v2-lite", "hardware": "h800", "tokens_per_gpu": 256, "loads": loads.tolist(),
             "cluster": {"num_gpus": 8, "slots_per_gpu": 9, "gpus_per_node": 4}}
    first = httpx.post(f"{base}/placement", json=setup, timeout=60).json()
    for run_async in (False, True):
        staged = httpx.post(f"{base}/placement", json={**setup, "stage_gib": 4, "async": run_async}, timeout=60)
        assert staged.status_code == 422, staged.text
        assert staged.json()["detail"] == "stage_gib: a migration plan needs the serving placement (give " \
            "current_placement)"
        assert [e["field"] for e in staged.json()["errors"]] == ["stage_gib"]
        limited = httpx.post(f"{base}/placement", json={**setup, "node_limit": 2, "async": run_async}, timeout=60)
        assert limited.status_code == 422, limited.text
        assert [e["field"] for e in limited.json()["errors"]] == ["node_limit", "coactivation"]
        assert "a node limit caps the nodes a token reaches: it needs the window's co-activation summary" in \
            limited.json()["detail"]
    judged = {k: v for k, v in setup.items() if k not in ("cluster", "tokens_per_gpu")}
    judged.update(placement=first["placement"], gpus_per_node=4, node_limit=2)
    evaluated = httpx.post(f"{base}/evaluate", json=judged, timeout=60)
    assert evaluated.status_code == 422 and [e["field"] for e in evaluated.json()["errors"]] == [
        "node_limit", "coactivation"], evaluated.text
    summary = summarize(ids, 64).to_dict()
    assert httpx.post(f"{base}/evaluate", json={**judged, "coactivation": summary}, timeout=60).status_code == 200
    both = {**setup, "node_limit": 2, "coactivation": summary, "current_placement": first["placement"],
            "stage_gib": 4}
    assert httpx.post(f"{base}/placement", json=both, timeout=60).status_code == 200


def test_a_job_leaves_out_the_fields_it_has_no_value_for_as_docs_say(base: str) -> None:
    """docs/api.md lists the job object's fields and says one with no value yet is absent, as in every answer
    (response_model_exclude_none): a finished job has started_at and finished_at, result when done, no error; the
    list has no result."""
    body = {**FIELDS, "loads": V3.tolist(), "async": True}
    accepted = httpx.post(f"{base}/placement", json=body, timeout=60)
    assert accepted.status_code == 202
    job = accepted.json()
    assert {"id", "status", "created_at"} <= set(job) and "result" not in job and "error" not in job
    for _ in range(600):
        job = httpx.get(f"{base}/jobs/{job['id']}", timeout=30).json()
        if job["status"] == "done":
            break
        time.sleep(0.1)
    assert set(job) == {"id", "status", "created_at", "started_at", "finished_at", "result"}, sorted(job)
    listed = next(j for j in httpx.get(f"{base}/jobs", timeout=30).json()["jobs"] if j["id"] == job["id"])
    assert set(listed) == {"id", "status", "created_at", "started_at", "finished_at"}, sorted(listed)
