"""Compiled swap loop of solvers.coactivation (solvers/_coact.c). Arrays are C-contiguous float64 / int64."""

import numpy as np
from numpy.typing import NDArray

_F = NDArray[np.float64]
_I = NDArray[np.int64]

def weights(pairs: _F, row: _I, rep: _F, out: _F, rows: int, cols: int, num_slots: int) -> None: ...
def refine(
    weight: _F,
    affinity: _F,
    slot_loads: _F,
    gpu_loads: _F,
    cap: _F,
    row: _I,
    gpu: _I,
    num_slots: int,
    num_gpus: int,
    num_experts: int,
    num_rows: int,
    max_swaps: int,
    rounds: int = 0,
    kick: int = 0,
) -> int | None: ...
