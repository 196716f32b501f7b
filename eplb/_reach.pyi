"""Compiled token reach of eplb.coactivation (eplb/_reach.c). Arrays are C-contiguous int64 (ids: int16, int32
or int64)."""

from typing import Any

import numpy as np
from numpy.typing import NDArray

_I = NDArray[np.int64]

def route(
    ids: NDArray[Any],
    tokens: int,
    layers: int,
    k: int,
    offsets: _I,
    steps: int,
    table: _I,
    count: _I,
    experts: int,
    width: int,
    rule: int,
    gpus: int,
    gpus_per_node: int,
    nodes: int,
    mode: int,
    out: _I,
) -> bool | None: ...
def counts(
    ids: NDArray[Any], tokens: int, layers: int, k: int, offsets: _I, steps: int, experts: int, out: _I | None
) -> bool | None: ...
