"""Compiled pass of eplb.replay.evaluate (eplb/replay/_evaluate.c). Arrays are C-contiguous."""

from typing import Any

import numpy as np
from numpy.typing import NDArray

_F32 = NDArray[np.float32]
_F64 = NDArray[np.float64]
_I64 = NDArray[np.int64]

instruction_set: str  # the loop bodies in use: "avx512", "avx2", "base" (4 lanes) or "scalar" (no vector extensions)

def evaluate(
    counts: NDArray[Any],
    kind: str,
    steps: int,
    layers: int,
    experts: int,
    expert: _I64,
    share: _F32,
    placements: int,
    slots: int,
    bounds: _I64,
    gpus: int,
    total: _F64,
    have_total: bool,
    lb: _F64,
    rmax: _F32,
    rmin: _F32,
    amax: _F32,
    rows: _F32 | None,
    active: _F32 | None,
    threads: int,
) -> None: ...
