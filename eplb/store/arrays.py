"""Arrays as compact database blobs: a zlib-compressed `.npy` image (dtype and shape travel with the bytes).

A [61, 256] float64 window takes ~125 kB as numbers in JSON text and a few kB here."""

from __future__ import annotations

import io
import zlib
from typing import Any

import numpy as np
from numpy.typing import NDArray


def pack(array: NDArray[Any]) -> bytes:
    """`array` as compressed .npy bytes (no pickled objects)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return zlib.compress(buffer.getvalue(), 6)


def unpack(blob: bytes) -> NDArray[Any]:
    """The array `pack` stored."""
    out: NDArray[Any] = np.load(io.BytesIO(zlib.decompress(blob)), allow_pickle=False)
    return out
