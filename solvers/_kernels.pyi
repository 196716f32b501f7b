"""Compiled loops of solvers.greedy (solvers/_kernels.c). Arrays are C-contiguous float64 / int64."""

import numpy as np
from numpy.typing import NDArray

_F = NDArray[np.float64]
_I = NDArray[np.int64]

def replicate(
    weight: _F,
    rows: int,
    num_log: int,
    num_physical: _I,
    width: int,
    max_replicas: int,
    f32: bool,
    phy2log: _I,
    rank: _I,
    logcnt: _I,
) -> None: ...
def argsort_desc(values: _F, rows: int, n: int, like_torch: bool, out: _I) -> None: ...
def pack(
    weight: _F,
    rows: int,
    n: int,
    order: _I,
    capacity: _I,
    bins: int,
    experts: _I | None,
    num_experts: int,
    f32: bool,
    bin_of: _I,
    rank: _I,
) -> None: ...
def deepseek_rows(
    weight: _F, rows: int, n_log: int, n_phy: int, packs: int, phy2log: _I, rank: _I, logcnt: _I
) -> None: ...
def place(
    loads: _F,
    rows: int,
    num_log: int,
    capacity: _I,
    bins: int,
    width: int,
    max_replicas: int,
    out: _I,
    stuck: NDArray[np.bool_],
) -> None: ...
def refine(
    expert: _I,
    loads: _F,
    rows: int,
    num_physical: int,
    num_experts: int,
    slots_per_gpu: _I,
    gpus: int,
    max_rounds: int,
) -> int: ...
def greedy(
    loads: _F,
    rows: int,
    num_log: int,
    slots_per_gpu: _I,
    gpus: int,
    max_replicas: int,
    max_rounds: int,
    out: _I,
    stuck: NDArray[np.bool_],
) -> int: ...
def search(
    expert: _I,
    loads: _F,
    rows: int,
    num_physical: int,
    num_experts: int,
    slots_per_gpu: _I,
    gpus: int,
    max_replicas: int,
    max_rounds: int,
    max_search: int,
    pair_experts: int,
    budget: int,
) -> int: ...
def log2phy(phy2log: _I, rank: _I, rows: int, n_phy: int, n_log: int, maxcnt: int, out: _I) -> None: ...
def take(src: _F | _I, idx: _I, rows: int, n_src: int, n_idx: int, inverse: bool, out: _F | _I) -> None: ...
