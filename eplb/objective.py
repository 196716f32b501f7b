"""What a solve minimizes: token balance (`lb`, every solver's own objective) or predicted layer time (`time`).

`time` takes the solver's placement as the first candidate and adds, per layer, placements that trade token
balance for something the cost model says is worth more:
- co-location: with a co-activation summary, `solvers.coactivation.refine_coactivation_chain` swaps slots
  so experts chosen together share a GPU (fewer all-to-all copies), within lb caps of `SLACKS` above the
  solver's busiest GPU, each cap's search starting from the tighter one's result (global placements only:
  the swaps may cross nodes); with two links (NVLink within a node, a NIC between nodes) also on nodes
  (`refine_on_nodes`: a token crosses the NIC once per other node it reaches);
- fewer replicas: from scratch (no serving placement; global placements only), greedy on one slot per expert,
  the extra slots left empty (-1), so no GPU reads a redundant replica's weights (decode, where weight reads
  bound the layer).
Each layer keeps the candidate with the lowest predicted layer time (`eplb.cost.predict`, with the summary's
copies per GPU when there is one) if it is at least `MIN_GAIN` faster than the solver's own, so the time
objective is never predicted slower than `lb` on any layer, and without co-activation data it changes only
layers where reading fewer replicas' weights is faster (docs/solvers.md, "Objectives").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from eplb.errors import EplbError
from solvers.validation import EMPTY_SLOT

if TYPE_CHECKING:
    from eplb.coactivation import CoactivationSummary

__all__ = ["OBJECTIVES", "SLACKS", "Choice", "candidates", "choose_by_time", "one_slot_per_expert"]

OBJECTIVES = ("lb", "time")
SLACKS = (0.005, 0.01, 0.02, 0.05)
"""lb caps (relative to the solver's busiest GPU) of the co-location candidates."""
MIN_GAIN = 0.001
"""A layer leaves the solver's placement only for a candidate predicted at least 0.1% faster."""

IntArray = NDArray[np.int64]
F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Choice:
    """The time objective's pick. phy2log: [L, P]; chosen: [L] candidate index per layer (0 = the solver's
    own); names: [C] what each candidate is; time_us: [C, L] predicted layer time of every candidate."""

    phy2log: IntArray
    chosen: IntArray
    names: list[str]
    time_us: F64

    def info(self) -> dict[str, object]:
        """JSON-ready summary for the solver block of an answer."""
        counts = np.bincount(self.chosen, minlength=len(self.names))
        return {
            "objective": "time",
            "layer_choice": [self.names[i] for i in self.chosen.tolist()],
            "candidates": {n: int(c) for n, c in zip(self.names, counts.tolist(), strict=True)},
        }


def one_slot_per_expert(loads: F64, slots_per_gpu: IntArray) -> IntArray:
    """Greedy with no redundant replica: E of the slots used (spread over the GPUs in proportion to their
    slots), the rest empty (-1); with more GPUs than experts, the GPUs left without one hold none. loads: [L, E];
    slots_per_gpu: [G]. Returns phy2log [L, sum(slots)]."""
    from solvers.greedy import solve_greedy

    slots = np.asarray(slots_per_gpu, dtype=np.int64)
    num_experts = loads.shape[1]
    used = np.minimum(slots, np.floor(num_experts * slots / slots.sum()).astype(np.int64))
    while int(used.sum()) < num_experts:  # hand out the remainder to the GPUs with most room left
        used[int(np.argmax(slots - used))] += 1
    packed = solve_greedy(loads, used[used > 0])  # greedy packs onto GPUs of at least one slot
    out = np.full((loads.shape[0], int(slots.sum())), EMPTY_SLOT, dtype=np.int64)
    starts, packed_starts = np.cumsum(slots) - slots, np.cumsum(used) - used
    for g in range(slots.size):
        out[:, starts[g] : starts[g] + used[g]] = packed[:, packed_starts[g] : packed_starts[g] + used[g]]
    return out


def choose_by_time(candidates: list[tuple[str, IntArray]], layer_time: Callable[[IntArray], F64]) -> Choice:
    """Per layer, the candidate placement with the lowest predicted time. candidates: (name, phy2log [L, P])
    pairs, the first the solver's own; layer_time: phy2log -> predicted time µs per layer [L]."""
    if not candidates:
        raise EplbError("the time objective needs at least one candidate placement")
    t = np.stack([layer_time(p2l) for _, p2l in candidates])  # [C, L]
    chosen = np.argmax(t <= t.min(axis=0) * (1 + 1e-9), axis=0).astype(np.int64)  # first of the fastest
    chosen[t[chosen, np.arange(t.shape[1])] > t[0] * (1 - MIN_GAIN)] = 0  # a gain within noise keeps the solver's
    stack = np.stack([p for _, p in candidates])  # [C, L, P]
    phy2log = stack[chosen, np.arange(stack.shape[1])]
    return Choice(phy2log, chosen, [n for n, _ in candidates], t)


def candidates(
    loads: F64,
    phy2log: IntArray,
    slots_per_gpu: IntArray,
    *,
    coactivation: CoactivationSummary | None,
    scenarios: F64 | None = None,
    colocate: bool = True,
    fewer_replicas: bool = True,
    nodes: int | None = None,
) -> list[tuple[str, IntArray]]:
    """The time objective's candidates [(name, phy2log [L, P])], the solver's own placement first.
    colocate: add co-location swaps (needs `coactivation`; not for hierarchical placements); nodes: GPUs per
    node when the all-to-all crosses a NIC between nodes (two links): also co-location on nodes
    (`solvers.coactivation.refine_on_nodes`); fewer_replicas: add `one_slot_per_expert` (from scratch only: it
    does not start from the serving one)."""
    from solvers.coactivation import refine_coactivation_chain, refine_on_nodes

    out: list[tuple[str, IntArray]] = [("solver", phy2log)]
    if coactivation is not None and colocate:
        pairs = coactivation.pair_estimate()
        chain = refine_coactivation_chain(loads, phy2log, slots_per_gpu, pairs, SLACKS, scenarios=scenarios)
        for slack, (refined, _) in zip(SLACKS, chain, strict=True):
            out.append((f"co-locate lb+{slack:.1%}", refined))
        if nodes is not None and nodes < slots_per_gpu.size:
            on_nodes = refine_on_nodes(loads, phy2log, slots_per_gpu, nodes, pairs, SLACKS, scenarios=scenarios)
            for slack, refined in zip(SLACKS, on_nodes, strict=True):
                out.append((f"co-locate on nodes lb+{slack:.1%}", refined))
    if fewer_replicas and int(slots_per_gpu.sum()) > loads.shape[1]:
        out.append(("one slot per expert", one_slot_per_expert(loads, slots_per_gpu)))
    return out
