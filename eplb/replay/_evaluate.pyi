"""Compiled inner loop of eplb.replay.evaluate (eplb/replay/_evaluate.c). Arrays are C-contiguous."""

from typing import Any

import numpy as np
from numpy.typing import NDArray

_F32 = NDArray[np.float32]
_I64 = NDArray[np.int64]

def gpu_loads(
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
    rmax: _F32,
    rmin: _F32,
    amax: _F32,
    rows: _F32 | None,
    active: _F32 | None,
) -> None: ...
