"""A `.npy` image from bytes a client sent (a request body, a member of a binary co-activation summary), read
without trusting its header: numpy's reader allocates the shape the header declares before it reads a byte of
data, so a 200-byte image claiming (100000000, 100000) float64 asks for 72.8 TiB. Here the header's shape times
its item size must equal the bytes that follow it, and the array is a view of those bytes (no pickles, no
object arrays, no allocation beyond the data given)."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from numpy.lib import format as npy_format
from numpy.typing import NDArray

from eplb.errors import EplbError, single_spaced

__all__ = ["NpyError", "read_npy"]

MAX_HEADER_BYTES = 10_000  # numpy's own limit for a header it reads without allow_pickle


class NpyError(EplbError):
    """Bytes that are no .npy image, or one whose header does not describe the bytes after it."""


def read_npy(data: bytes) -> NDArray[Any]:
    """The array of a .npy image (format versions 1.0 and 2.0), a read-only view of `data`; NpyError (one line)
    when the bytes are no such image: no numpy magic string, an unreadable header, an object dtype, or a shape x
    item size that is not the number of bytes after the header."""
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
    except ValueError:
        raise NpyError(f"not a .npy array: it does not start with numpy's magic string \\x93NUMPY (first bytes "
                       f"{data[:8]!r})") from None
    if version == (1, 0):
        read_header = npy_format.read_array_header_1_0
    elif version == (2, 0):
        read_header = npy_format.read_array_header_2_0
    else:
        raise NpyError(f"not a .npy array this service reads: format version {version[0]}.{version[1]} "
                       "(1.0 and 2.0 are; np.save writes them)")
    try:
        shape, fortran_order, dtype = read_header(stream, max_header_size=MAX_HEADER_BYTES)
    except Exception as exc:  # any failure to parse a client's header is a bad body
        reason = single_spaced(exc)[:200]
        raise NpyError(f"not a .npy array: its header is unreadable ({reason})") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise NpyError(f"not a .npy array of numbers: its dtype is {dtype}")
    if any(n < 0 for n in shape):
        raise NpyError(f"not a .npy array: its header declares a negative shape {list(shape)}")
    count = math.prod(shape)
    needed, offset = count * dtype.itemsize, stream.tell()
    present = len(data) - offset
    if needed != present:
        raise NpyError(f"not a .npy array: its header declares shape {list(shape)} of {dtype} ({needed:,} bytes), "
                       f"but {present:,} bytes follow the header")
    flat = np.frombuffer(memoryview(data)[offset:], dtype=dtype, count=count)
    if fortran_order:
        return flat.reshape(shape[::-1]).transpose()
    return flat.reshape(shape)
