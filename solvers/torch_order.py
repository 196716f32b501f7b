"""PyTorch CPU orders that DeepSeek EPLB's results depend on: sort ties and float32 sums.

DeepSeek EPLB sorts with `tensor.sort(-1, descending=True)`, which is not stable: on the CPU it runs the
C++ standard library's introsort (GCC's libstdc++), and rows longer than 16 come back with ties in an
order that depends on that algorithm. Replicas of one expert always tie, so reproducing DeepSeek's
`log2phy` exactly needs the same order (`argsort_desc_like_torch`, compiled in solvers/_kernels.c).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from solvers import _kernels


def argsort_desc_like_torch(values: NDArray[Any]) -> NDArray[np.int64]:
    """Indices sorting each row of values [rows, n] descending, ties ordered as torch's CPU sort."""
    rows, n = values.shape
    out = np.empty((rows, n), dtype=np.int64)
    _kernels.argsort_desc(np.ascontiguousarray(values, dtype=np.float64), rows, n, True, out)
    return out


# Float32 sums: torch's CPU `sum(-1)` over a contiguous last dimension (SumKernel.cpp's cascade sum) adds
# in a fixed order that differs from numpy's pairwise sum, so float32 results can differ in the last bit
# (loads above 2^24 tokens). Rows of at least one vector (8 floats with AVX2 and the default build) are
# summed as 8-lane vectors, four accumulators side by side, then a scalar tail, then the lanes in order;
# shorter rows as four interleaved scalar accumulators. Chunks of 16 steps are folded into a second
# accumulator level (a cascade, deeper ones for very long rows). AVX-512 builds use 16 lanes.
_LANES = 8
_ILP = 4
_LEVELS = 4


def sum_last_like_torch(values: NDArray[np.float32]) -> NDArray[np.float32]:
    """float32 sums of each row of values [rows, n], added in the order torch's CPU sum(-1) adds them."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    rows, n = x.shape
    if n < _LANES:
        return _row_sum(x[:, :, None])[:, 0]
    vectors = n // _LANES
    lanes = _row_sum(x[:, : vectors * _LANES].reshape(rows, vectors, _LANES))
    total = np.zeros(rows, dtype=np.float32)
    for k in range(vectors * _LANES, n):
        total += x[:, k]
    for lane in range(_LANES):
        total += lanes[:, lane]
    return total


def _row_sum(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """x [rows, n, lanes] -> [rows, lanes]: torch's row_sum, four accumulators over interleaved elements."""
    rows, n, lanes = x.shape
    size = n // _ILP
    partial = _multi_row_sum(x[:, : size * _ILP].reshape(rows, size, _ILP, lanes))
    for i in range(size * _ILP, n):
        partial[:, 0] += x[:, i]
    for k in range(1, _ILP):
        partial[:, 0] += partial[:, k]
    return partial[:, 0]


def _multi_row_sum(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """x [rows, size, nrows, lanes] -> [rows, nrows, lanes]: torch's multi_row_sum (cascade of levels)."""
    rows, size, nrows, lanes = x.shape
    ceil_log2 = 1 if size <= 2 else int(size - 1).bit_length()
    power = max(4, ceil_log2 // _LEVELS)
    step, mask = 1 << power, (1 << power) - 1
    acc = np.zeros((_LEVELS, rows, nrows, lanes), dtype=np.float32)
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] += x[:, i]
            i += 1
        for j in range(1, _LEVELS):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & (mask << (j * power)):
                break
    while i < size:
        acc[0] += x[:, i]
        i += 1
    for j in range(1, _LEVELS):
        acc[0] += acc[j]
    out: NDArray[np.float32] = acc[0]
    return out
