"""Exact expert placement with OR-Tools CP-SAT: balance, weighted shares, migration.

One layer's problem, for ``E`` logical experts with loads ``w[e]`` (tokens) and ``G`` GPUs with
``slots[g]`` slots (``P = sum(slots)``):

Balance (uniform shares, what serving systems route today)::

    x[e, g] in {0, 1}                 expert e has a replica on GPU g (at most one per GPU)
    r[e] = sum_g x[e, g] >= 1         replica count, chosen jointly with the placement
    sum_e x[e, g] == slots[g]         every slot holds an expert
    load[g] = sum_e x[e, g] w[e] / r[e] <= T,     minimize T

``w[e] / r[e]`` is linearized with a one-hot ``z[e, k]`` ("e has k replicas"). Loads are scaled to
integer units (about 1e7 per mean GPU load) and rounded down, so the model never overstates a load;
every objective reported is recomputed exactly from the float loads, and every bound is corrected for
the rounding.

Weighted shares (``split="weighted"``): the replicas of an expert serve unequal parts ``f[e, g]`` of its
tokens; the serving system needs weighted replica selection to realise them.

Migration (``current_phy2log`` given): after the balance solve, a second solve minimizes the (expert,
GPU) pairs absent from the current placement subject to ``max load <= (1 + max_lb_slack) * best``.

Modules, in the order a request flows through them:

* :mod:`~solvers.milp.runner`: :func:`solve_milp`, one task per layer (per layer and node under the
  hierarchical policy) on threads, results assembled into a :class:`MilpResult`;
* :mod:`~solvers.milp.driver`: one layer: balance, then fewest copies; status per layer;
* :mod:`~solvers.milp.search`: neighbourhood search (a few GPUs re-solved exactly at a time: DeepSeek
  sized layers, where the full model spends its time in presolve) and the full model;
* :mod:`~solvers.milp.model`: the x[e, g] CP-SAT model, whole or restricted to a neighbourhood;
* :mod:`~solvers.milp.patterns`: the symmetry-free pattern model that proves small uniform layers;
* :mod:`~solvers.milp.shares`: the LP that sets weighted shares of a fixed placement;
* :mod:`~solvers.milp.layer`: one layer's data in model units and a placement state;
* :mod:`~solvers.milp.solver`: the registered solvers "milp" and "milp-weighted".

GPU loads of a placement live in :mod:`solvers.loads` (no OR-Tools import).
"""

from solvers.loads import gpu_loads, max_gpu_loads
from solvers.milp.driver import LayerStatus
from solvers.milp.runner import MilpResult, available_cores, solve_milp
from solvers.milp.shares import lp_shares
from solvers.milp.solver import DEFAULT_LAYER_LIMIT_S, MilpSolver, WeightedMilpSolver

__all__ = [
    "DEFAULT_LAYER_LIMIT_S",
    "LayerStatus",
    "MilpResult",
    "MilpSolver",
    "WeightedMilpSolver",
    "available_cores",
    "gpu_loads",
    "lp_shares",
    "max_gpu_loads",
    "solve_milp",
]
