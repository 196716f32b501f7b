"""Synthetic expert loads.

`seed004_counts()` rebuilds, call for call, the routing simulation of the DP+EP article's section 5.2
(our seed 004): power-law expert popularity with exponent 0.4, shuffled over expert ids, 4096 tokens
each picking 8 distinct experts out of 256 with Python's `random` seeded with 0. Its published output
(hottest expert 640 tokens, coldest 67, mean 128) is the check that the counts are the same.
"""

from __future__ import annotations

import random

import numpy as np
from numpy.typing import NDArray

SEED004_TABLE = {
    # EP: (contiguous, load-sorted without redundancy, one redundant expert per GPU), seed 004 section 5.2
    8: (1.14, 1.01, 1.00),
    32: (1.41, 1.17, 1.00),
    64: (1.93, 1.64, 1.00),
    256: (5.00, 5.00, 1.01),
}


def seed004_counts(
    num_experts: int = 256, top_k: int = 8, tokens: int = 4096, skew: float = 0.4, seed: int = 0
) -> NDArray[np.int64]:
    """Tokens routed to each expert in one step: [num_experts], as seed 004 section 5.2 draws them."""
    rng = random.Random(seed)
    popularity = [1 / (rank + 1) ** skew for rank in range(num_experts)]
    rng.shuffle(popularity)
    experts = range(num_experts)
    counts = [0] * num_experts
    for _ in range(tokens):
        picked: set[int] = set()
        while len(picked) < top_k:
            picked.add(rng.choices(experts, weights=popularity)[0])
        for e in picked:
            counts[e] += 1
    return np.asarray(counts, dtype=np.int64)
