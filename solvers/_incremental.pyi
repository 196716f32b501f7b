"""Compiled move loop of solvers.incremental (solvers/_incremental.c). Arrays are C-contiguous float64 / int64."""

import numpy as np
from numpy.typing import NDArray

_F = NDArray[np.float64]
_I = NDArray[np.int64]

def walk(
    loads: _F,
    phy2log: _I,
    slots_per_gpu: _I,
    num_layers: int,
    num_experts: int,
    num_physical: int,
    num_gpus: int,
    max_steps: int,
    light_gpus: int,
    node_ok: _I | None,
    group_size: int,
    node_size: int,
    num_groups: int,
    num_nodes: int,
    target: _F,
    max_copies: int,
    min_gain: _F,
    out_max: _F,
    out_copies: _I,
    out_steps: _I,
    out_slot: _I,
    out_expert: _I,
    level: _F,
    rank_by_peak: float,
    max_repairs: _I,
    out_repairs: _I,
) -> None: ...
