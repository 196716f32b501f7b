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
