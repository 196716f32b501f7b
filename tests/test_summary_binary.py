"""The co-activation summary's binary form (base64 of its .npz image) in the library and the service."""

from __future__ import annotations

import base64
import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from eplb.coactivation import BINARY_MAX, CoactivationSummary, read_topk, summarize
from eplb.errors import EplbError
from eplb.io.windows import read_window

LAW = Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"


@pytest.fixture(scope="module")
def summary() -> CoactivationSummary:
    ids, _ = read_topk(LAW)
    return summarize(ids, 64)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def npz(**arrays: Any) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_binary_and_json_forms_give_the_same_summary(summary: CoactivationSummary) -> None:
    binary = CoactivationSummary.parse(b64(summary.to_bytes()))
    assert binary.to_dict() == CoactivationSummary.parse(summary.to_dict()).to_dict() == summary.to_dict()
    assert len(summary.to_bytes()) * 2 < len(str(summary.to_dict()))


def test_binary_summary_is_checked_like_the_json_one(summary: CoactivationSummary) -> None:
    fields = {"tokens": summary.tokens, "top_k": np.int64(summary.top_k), "loads": summary.loads,
              "partners": summary.partners, "counts": summary.counts}  # fmt: skip
    bad_partner = {**fields, "partners": np.where(summary.partners == 3, 64, summary.partners)}
    cases = [
        ("not base64!", "base64"),
        (b64(b"plain bytes"), "not a .npz image"),
        (b64(npz(**{k: v for k, v in fields.items() if k != "counts"})), "missing array"),
        (b64(npz(**bad_partner)), "partners must be expert ids in 0..63"),
        (b64(npz(**{**fields, "loads": summary.loads[:2]})), "loads must be [L, E]"),
        (b64(npz(**{**fields, "top_k": np.int64(0)})), "top_k must be >= 1"),
        (b64(npz(**{**fields, "top_k": np.float64(2.5)})), "top_k must be a whole number"),
        (b64(npz(**{**fields, "loads": summary.loads + 0.5})), "loads must be whole numbers"),
        (b64(npz(**{**fields, "loads": np.where(summary.loads > 0, summary.loads, np.nan)})), "whole numbers"),
        (b64(npz(**{**fields, "counts": summary.counts.astype(np.uint64) + np.uint64(2**63)})), "out of range"),
    ]
    for value, message in cases:
        with pytest.raises(EplbError, match=message.replace("[", r"\[").replace("]", r"\]")):
            CoactivationSummary.parse(value)
    ragged = {**summary.to_dict(), "loads": [[1, 2], [3]]}
    with pytest.raises(EplbError, match="rectangular arrays of whole numbers"):
        CoactivationSummary.parse(ragged)
    # an archive that would unpack to more than BINARY_MAX is refused before any array is read
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("counts.npy", b"\0" * (BINARY_MAX + 1))
    with pytest.raises(EplbError, match="unpacks to more than"):
        CoactivationSummary.parse(b64(buffer.getvalue()))


def test_service_takes_the_binary_summary(server_factory: Callable[..., str], summary: CoactivationSummary) -> None:
    base = server_factory()
    loads = read_window(LAW).loads
    body = {"model": "deepseek-v2-lite", "hardware": "h800", "link": "nic", "tokens_per_gpu": 256, "objective": "time",
            "cluster": {"num_gpus": 8, "slots_per_gpu": 9}, "loads": loads.tolist()}  # fmt: skip
    as_json = httpx.post(f"{base}/placement", json={**body, "coactivation": summary.to_dict()}, timeout=120)
    as_binary = httpx.post(f"{base}/placement", json={**body, "coactivation": b64(summary.to_bytes())}, timeout=120)
    assert as_json.status_code == 200 and as_binary.status_code == 200, (as_json.text, as_binary.text)
    a, b = as_json.json(), as_binary.json()
    assert a["placement"] == b["placement"] and a["predicted"] == b["predicted"]
    assert b["predicted"]["copies_per_token"] is not None
    short = CoactivationSummary(summary.tokens[:2], summary.top_k, summary.loads[:2], summary.partners[:2],
                                summary.counts[:2])  # fmt: skip
    for value, message in ((b64(short.to_bytes()), "is for 2 layers"), ("%%%", "coactivation"),
                           (b64(b"nope"), "not a .npz image")):  # fmt: skip
        bad = httpx.post(f"{base}/placement", json={**body, "coactivation": value}, timeout=60)
        assert bad.status_code == 422 and bad.headers["content-type"].startswith("application/problem+json")
        assert message in bad.text and "Traceback" not in bad.text, bad.text
    # deployments keep what a window carried, in either form
    config = {"model": "deepseek-v2-lite", "hardware": "h800", "link": "nic", "tokens_per_gpu": 256.0,
              "cluster": {"num_gpus": 8, "slots_per_gpu": 9}}  # fmt: skip
    answers = []
    forms: list[tuple[str, Any]] = [("as-json", summary.to_dict()), ("as-binary", b64(summary.to_bytes()))]
    for name, value in forms:
        assert httpx.put(f"{base}/deployments/{name}", json=config, timeout=30).status_code == 201
        sent = httpx.post(f"{base}/deployments/{name}/windows", json={"loads": loads.tolist(), "coactivation": value},
                          timeout=120)  # fmt: skip
        assert sent.status_code == 200, sent.text
        answers.append(sent.json()["result"])
    assert answers[0]["predicted"]["copies_per_token"] is not None
    assert answers[0]["placement"] == answers[1]["placement"] and answers[0]["predicted"] == answers[1]["predicted"]


def lying_npy(shape: tuple[int, ...], descr: str = "<i8", data: bytes = b"\0" * 80) -> bytes:
    """A v1.0 .npy image whose header declares `shape` over only `data`."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}".encode()
    header += b" " * (127 - 10 - len(header) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


def test_a_member_whose_header_lies_about_its_shape_is_refused_unread(summary: CoactivationSummary) -> None:
    """tokens.npy claiming [1e8, 1e6] int64 (728 TiB) over 80 bytes: the header is checked against the bytes the
    entry holds before numpy allocates the shape (it was a MemoryError, a 500 in the service)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(summary.to_bytes())) as source, \
            zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in source.namelist():
            archive.writestr(name, lying_npy((100_000_000, 1_000_000)) if name == "tokens.npy" else source.read(name))
    with pytest.raises(EplbError, match=r"tokens.npy is not a .npy array: its header declares shape "
                                        r"\[100000000, 1000000\] of int64 \(800,000,000,000,000 bytes\), but 80 "):
        CoactivationSummary.parse(b64(buffer.getvalue()))
    noise = npz(**{"tokens": summary.tokens})
    with zipfile.ZipFile(io.BytesIO(noise)) as archive:
        assert archive.namelist() == ["tokens.npy"]
    with pytest.raises(EplbError, match="missing array 'top_k'"):
        CoactivationSummary.parse(b64(noise))
