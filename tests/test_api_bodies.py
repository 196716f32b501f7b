"""How every route reads its body: one 400 for a body that is not JSON (an empty one too), whichever route."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.event_loop import healthz_while, loop_was_free

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


LOADS_RULE = "loads are [layers][experts] numbers of tokens (NaN is not accepted; send 0 for an expert without tokens)"
IDS_RULE = "expert ids are [layers][slots] whole numbers from -1 to 65,535 (-1: an empty slot)"
MIXTRAL = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4}}  # 8 experts, 4 GPUs: 12 slots with the default


def nulls(rows: int, experts: int = 4096, value: str = "null") -> str:
    return "[" + ",".join(["[" + ",".join([value] * experts) + "]"] * rows) + "]"


def post(base: str, path: str, content: str | bytes, method: str = "POST") -> httpx.Response:
    data = content.encode() if isinstance(content, str) else content
    return httpx.request(method, f"{base}{path}", content=data, headers={"content-type": "application/json"},
                         timeout=120)


def one_error(r: httpx.Response, field: str, message: str) -> None:
    """A 422 of one error, its message naming the element, and the detail that message."""
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, r.text[:300]
    assert r.json()["errors"] == [{"field": field, "message": message}], r.text[:500]
    assert r.json()["detail"] == message, r.text[:500]
    assert len(r.content) < 1000, len(r.content)


def test_an_array_of_nulls_is_one_error_naming_the_first_not_one_per_element(base: str) -> None:
    """A 2 MB body of 409,600 nulls as loads took 11.6 s and answered 28 MB of 409,600 errors (0.8 GB in the
    parser); 4 MB of them in a deployment's window held the event loop 16.5 s and grew the server by 1.1 GB. A
    numeric array is refused in one error now, naming its first bad element (`eplb.schemas.Numbers`)."""
    assert httpx.put(f"{base}/deployments/nulls", json={"model": "deepseek-v3", "cluster": {"num_gpus": 32}},
                     timeout=60).status_code in (200, 201)
    one_error(post(base, "/placement", '{"cluster":{"num_gpus":32},"loads":' + nulls(100) + "}"), "loads",
              f"loads[0][0] is null: {LOADS_RULE}")
    one_error(post(base, "/deployments/nulls/windows", '{"loads":' + nulls(200) + "}"), "loads",
              f"loads[0][0] is null: {LOADS_RULE}")
    one_error(post(base, "/deployments/nulls/windows", '{"loads":' + nulls(58, 256, '"1"') + "}"), "loads",
              f'loads[0][0] is "1": {LOADS_RULE}')  # 14,848 errors, 1 MB
    later = [[1.0] * 256] * 3 + [[1.0] * 100 + [True] + [1.0] * 155]
    one_error(httpx.post(f"{base}/evaluate", json={"loads": later, "placement": {
        "phy2log": [list(range(256))] * 4, "slots_per_gpu": [64] * 4}}, timeout=60), "loads",
              f"loads[3][100] is true: {LOADS_RULE}")


def test_every_numeric_array_of_a_request_gets_one_error_naming_its_element(base: str) -> None:
    """current_placement with float ids was 1,872 errors; one-dimensional loads 64 (the .npy form's one line: 'got
    one row of 256 numbers'); a co-activation summary's arrays and the per-GPU lists one error per element too."""
    assert httpx.put(f"{base}/deployments/arrays", json=MIXTRAL, timeout=60).status_code in (200, 201)
    loads = [[10.0, 20, 30, 40, 50, 60, 70, 80]] * 2
    floats = {"phy2log": [[float(e % 8) for e in range(12)]] * 2, "slots_per_gpu": [3] * 4}
    for path, body in (("/placement", {**MIXTRAL, "loads": loads}), ("/deployments/arrays/windows", {"loads": loads})):
        one_error(httpx.post(f"{base}{path}", json={**body, "current_placement": floats}, timeout=60),
                  "current_placement.phy2log", f"current_placement.phy2log[0][0] is 0.0: {IDS_RULE}")
        one_error(httpx.post(f"{base}{path}", json={**body, "loads": loads[0]}, timeout=60), "loads",
                  "loads must be [layers][experts]; got one row of 8 numbers (wrap a single layer in another list)")
        one_error(httpx.post(f"{base}{path}", json={**body, "loads": [loads[0], 5]}, timeout=60), "loads",
                  f"loads[1] is 5, not an array: {LOADS_RULE}")
        one_error(httpx.post(f"{base}{path}", json={**body, "loads": [loads[0], [1] * 7 + [-2]]}, timeout=60),
                  "loads", "loads[1][7] is -2: loads must be >= 0")  # /placement said 'loads: [1][7] is -2: ...'
        summary = {"tokens": [40, 40], "top_k": 2, "loads": [[10] * 8] * 2, "partners": [[[1, 2]] * 8] * 2,
                   "counts": [[[3, 1]] * 8, [[3, 1]] * 7 + [[3, None]]]}
        one_error(httpx.post(f"{base}{path}", json={**body, "coactivation": summary}, timeout=60),
                  "coactivation.counts", "coactivation.counts[1][7][1] is null: token counts are "
                  "[layers][experts][partners] whole numbers from 0 to 1e+15")
        summary = {**summary, "counts": [[[3, 1]] * 8] * 2, "partners": [[[1, 70_000]] * 8] * 2}
        one_error(httpx.post(f"{base}{path}", json={**body, "coactivation": summary}, timeout=60),
                  "coactivation.partners", "coactivation.partners[0][0][1] is 70000: partners are "
                  "[layers][experts][partners] whole numbers from -1 to 65,535 (expert ids; -1: no partner)")
    applied = {"phy2log": [[*range(8), 0, 1, 2, 3]] * 2, "slots_per_gpu": [3, 3, 3, "3"]}
    one_error(httpx.post(f"{base}/deployments/arrays/placement", json={"placement": applied}, timeout=60),
              "placement.slots_per_gpu", 'placement.slots_per_gpu[3] is "3": slot counts are whole numbers from 0 '
              "to 4,096")
    for route, method in (("/placement", "POST"), ("/deployments/arrays", "PUT")):
        body = {**MIXTRAL, "cluster": {"num_gpus": 4096, "slots_per_gpu": [None] * 4096}, "loads": loads}
        if method == "PUT":
            del body["loads"]
        one_error(httpx.request(method, f"{base}{route}", json=body, timeout=60), "cluster.slots_per_gpu",
                  "cluster.slots_per_gpu[0] is null: slot counts are whole numbers from 1 to 4,096")


def test_every_route_parses_a_large_body_away_from_the_event_loop(base: str) -> None:
    """A deployment's routes had FastAPI parse and validate their bodies in the event loop: /healthz waited 0.56 s
    while a 21 MB window was read (16.5 s for 4 MB of nulls). Every body is parsed where POST /placement parses
    a large one now, in the parser process (`api.offload.parse_body`)."""
    assert httpx.put(f"{base}/deployments/large", json=MIXTRAL, timeout=60).status_code in (200, 201)
    row = "[" + ",".join(["1234.5"] * 256) + "]"
    numbers = "[" + ",".join([row] * 11_999 + ["[" + ",".join(["1234.5"] * 255 + ['"x"']) + "]"]) + "]"  # 21 MB
    cases = [("POST", "/deployments/large/windows", '{"loads":' + numbers + "}", "loads",
              f'loads[11999][255] is "x": {LOADS_RULE}'),
             ("PUT", "/deployments/large", '{"model":"mixtral-8x7b","cluster":{"num_gpus":4},"padding":' + numbers
              + "}", "padding", "Extra inputs are not permitted"),
             ("POST", "/deployments/large/placement", '{"placement":{"slots_per_gpu":[1],"phy2log":' + numbers + "}}",
              "placement.phy2log", f"placement.phy2log[0][0] is 1234.5: {IDS_RULE}")]
    for method, path, content, field, message in cases:
        r, worst, took = healthz_while(base, lambda: post(base, path, content, method))  # noqa: B023
        assert loop_was_free(worst, took), (f"/healthz took {worst:.3f} s while {path} parsed a "
                                            f"{len(content) / 1e6:.0f} MB body in {took:.3f} s")
        assert r.status_code == 422 and r.json()["errors"] == [{"field": field, "message": message}], r.text[:300]
    assert httpx.get(f"{base}/deployments/large", timeout=60).json()["windows"] == 0


def test_a_numeric_array_takes_what_pydantic_took_and_gives_it_back_as_pydantic_did() -> None:
    """The one error (`eplb.schemas.Numbers`) keeps pydantic's strict rules and output: integers are floats in a
    float array, NaN and huge integers reach the loads' own check (which names them), a bool or a string is no
    number, an int array takes no float, and a value that is no list weighs in a union as before."""
    from pydantic import ValidationError

    from api.problems import field_errors
    from api.schemas import PlacementIn, PlacementRequest
    from eplb.schemas import ClusterRules

    request = PlacementRequest.model_validate_json(
        '{"cluster": {"num_gpus": 2}, "loads": [[1, 2.5, NaN, ' + str(10**400) + "]]}")
    assert [type(v) for v in request.loads[0]] == [float] * 4 and request.loads[0][:2] == [1.0, 2.5]
    assert request.loads[0][3] == float("inf")
    placement = PlacementIn.model_validate_json('{"phy2log": [[0, -1]], "slots_per_gpu": [2], "shares": [[1, 0.5]]}')
    assert placement.phy2log == [[0, -1]] and placement.shares == [[1.0, 0.5]]
    for bad, found in (("true", "true"), ("1.0", "1.0"), ("-2", "-2"), ("{}", "an object"), ("[1]", "an array")):
        with pytest.raises(ValidationError) as refused:
            PlacementIn.model_validate_json('{"phy2log": [[0, 1], [0, %s]], "slots_per_gpu": [2]}' % bad)  # noqa: UP031
        assert refused.value.error_count() == 1
        assert field_errors(refused.value.errors()) == [{"field": "phy2log", "message": f"phy2log[1][1] is {found}: "
                                                         f"{IDS_RULE}"}], bad
    with pytest.raises(ValidationError) as refused:
        ClusterRules.model_validate_json('{"num_gpus": 2, "slots_per_gpu": "2"}')
    assert field_errors(refused.value.errors()) == [{"field": "slots_per_gpu",
                                                     "message": "Input should be a valid integer or a valid array"}]
    assert ClusterRules.model_validate_json('{"num_gpus": 2, "memory_budget_bytes": [1, 2]}').memory_budget_bytes \
        == [1.0, 2.0]
