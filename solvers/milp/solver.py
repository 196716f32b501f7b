"""The MILP as registered solvers: "milp" (uniform shares) and "milp-weighted"."""

from __future__ import annotations

from typing import ClassVar

from solvers.milp.layer import Split
from solvers.milp.runner import solve_milp
from solvers.registry import Capabilities, Options, Problem, Solution, Solver

DEFAULT_LAYER_LIMIT_S = 5.0
"""Per-layer limit when neither a per-layer nor a whole-call limit is given, s."""


class MilpSolver(Solver):
    """Registered as "milp": `solve_milp` with uniform shares, warm-started from greedy (hierarchical
    greedy under the hierarchical policy, whose group-to-node assignment it keeps)."""

    name = "milp"
    summary = "exact CP-SAT search, warm-started from greedy (never worse); migration-aware with a current placement"
    capabilities = Capabilities(current=True, hierarchical=True, hierarchical_with_current=False)
    options = frozenset({"time_limit_s", "total_time_limit_s", "max_lb_slack"})
    split: ClassVar[Split] = "uniform"

    def solve(self, problem: Problem, options: Options) -> Solution:
        per_layer = options.time_limit_s or options.total_time_limit_s or DEFAULT_LAYER_LIMIT_S
        result = solve_milp(
            problem.loads,
            problem.slots_per_gpu,
            time_limit_s=per_layer,
            total_time_limit_s=options.total_time_limit_s,
            split=self.split,
            current_phy2log=problem.current_phy2log,
            max_lb_slack=options.max_lb_slack,
            num_groups=problem.num_groups if problem.hierarchical else None,
            gpus_per_node=problem.gpus_per_node if problem.hierarchical else None,
        )
        statuses: list[str] = list(result.status)
        overall = next((s for s in ("greedy_fallback", "time_limit", "feasible") if s in statuses), "optimal")
        info: dict[str, object] = {"time_limit_s_per_layer": per_layer}
        if problem.hierarchical:
            info["hierarchical"] = "each group stays on the node hierarchical greedy put it on; status per that"
        return Solution(
            result.phy2log,
            shares=result.shares,
            status=overall,
            layer_status=statuses,
            layer_ms=[round(float(v), 3) for v in result.wall_ms],
            # a hierarchical bound holds for greedy's group-to-node assignment only: report the general one
            bound_tokens=None if problem.hierarchical else result.bound,
            info=info,
        )


class WeightedMilpSolver(MilpSolver):
    """Registered as "milp-weighted": the MILP with weighted shares (needs weighted replica selection)."""

    name = "milp-weighted"
    summary = "the MILP with weighted shares per replica (the server must route by share)"
    capabilities = Capabilities(current=True, shares=True, aligned=True, hierarchical=True,
                                hierarchical_with_current=False)
    split = "weighted"
