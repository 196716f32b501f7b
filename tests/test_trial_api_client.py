"""eplb.client refuses an API key no HTTP request can carry as InvalidRequest, one line that does not show the key,
before sending anything: a non-ASCII key raised UnicodeEncodeError (a traceback from `eplb deployments list
--api-key`), an empty one or one with a line break 'Unreachable: cannot reach URL: Illegal header value b'Bearer
...'' (the key printed, and the service blamed)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from eplb.client import AsyncClient, Client, InvalidRequest

SENT: list[httpx.Request] = []


def _service(request: httpx.Request) -> httpx.Response:
    SENT.append(request)
    return httpx.Response(200, json={"deployments": []})


@pytest.mark.parametrize("key", ["", "   ", " Zq7lead", "Zq7trail\n", "Zq7line\nbreak", "Zq7nul\x00", "Zq7tab\tin",
                                 "ключ-Zq7", "clé-Zq7"])
def test_a_key_no_header_can_carry_is_refused_before_anything_is_sent(key: str) -> None:
    SENT.clear()
    transport = httpx.MockTransport(_service)
    with pytest.raises(InvalidRequest, match=r"^api_key \(not shown\)") as refused:
        Client("http://svc", api_key=key, transport=transport)
    assert "\n" not in str(refused.value)
    assert "Zq7" not in str(refused.value)  # the key is not shown
    with pytest.raises(InvalidRequest, match=r"^api_key \(not shown\)"):
        AsyncClient("http://svc", api_key=key, transport=transport)
    assert SENT == []


def test_a_key_of_printable_ascii_is_sent_as_given() -> None:
    SENT.clear()
    key = "k3y with spaces~!"
    with Client("http://svc", api_key=key, transport=httpx.MockTransport(_service)) as eplb:
        assert eplb.deployments() == []

    async def call() -> None:
        async with AsyncClient("http://svc", api_key=key, transport=httpx.MockTransport(_service)) as eplb:
            assert await eplb.deployments() == []

    asyncio.run(call())
    assert [r.headers["authorization"] for r in SENT] == [f"Bearer {key}"] * 2


@pytest.mark.parametrize("key", ["clé-Zq7", "Zq7\x00nul", "Zq7tab\tin", "Zq7line\nbreak"])
def test_the_service_refuses_a_key_no_header_can_carry_at_start(key: str) -> None:
    """EPLB_API_KEY='clé-...' started a service no client could authenticate to (httpx, the client and the plug-ins,
    send ASCII; the Gate decodes the header as latin-1, so a UTF-8 key never matched): refused, the key not shown."""
    from pydantic import ValidationError

    from api.settings import Settings
    from eplb.errors import SECRET_REFUSED

    with pytest.raises(ValidationError) as refused:
        Settings(api_key=key)
    (error,) = refused.value.errors()
    assert error["type"] == SECRET_REFUSED and "printable ASCII" in error["msg"], error
    assert "Zq7" not in error["msg"]
    assert Settings(api_key="k3y with spaces~!").api_key == "k3y with spaces~!"


def test_long_double_arrays_and_scalars_are_sent_as_floats() -> None:
    """A numpy array of np.longdouble (float128 on x86-64) raised TypeError 'Object of type longdouble is not JSON
    serializable' out of `placement`, and such a scalar was refused as 'a longdouble'; both are numbers."""
    import json

    import numpy as np

    bodies: list[object] = []

    def service(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(422, json={"type": "about:blank", "title": "Invalid request", "status": 422,
                                         "detail": "stop here"})

    with Client("http://svc", transport=httpx.MockTransport(service)) as eplb:
        loads = np.array([[1.5] * 8], dtype=np.longdouble)
        with pytest.raises(Exception, match="stop here"):
            eplb.placement(loads=loads, cluster={"num_gpus": 4}, tokens_per_gpu=np.longdouble(256))
        assert bodies == [{"loads": [[1.5] * 8], "cluster": {"num_gpus": 4}, "tokens_per_gpu": 256.0}]
        with np.errstate(over="ignore"), pytest.raises(InvalidRequest, match=r"^loads\[0\]\[1\] is inf: "):
            eplb.placement(loads=np.array([[1, np.longdouble(1e300) * np.longdouble(1e300)]], dtype=np.longdouble),
                           cluster={"num_gpus": 4})
    assert len(bodies) == 1
