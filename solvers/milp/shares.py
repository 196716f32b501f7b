"""Weighted shares of a fixed placement by LP (MathOpt, GLOP), and the exact max load a state returns."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from solvers.milp.layer import BoolArray, FloatArray, LayerData, State, state_from, state_shares, true_loads


def lp_shares(w: FloatArray, member: BoolArray) -> FloatArray | None:
    """Weighted shares minimizing the max GPU load of a fixed placement, by LP.

    ``w [E]`` tokens, ``member [E, G]`` placement. Solves ``min T`` s.t. ``sum_g f[e, g] == w[e]``,
    ``sum_e f[e, g] <= T``, ``f >= 0`` on the placement's pairs. Returns ``[E, G]`` shares (uniform
    for experts without load), or None if the LP did not solve to optimality.
    """
    from ortools.math_opt.python import mathopt

    mean = float(w.sum()) / member.shape[1]
    if mean <= 0:
        return None
    scaled = w / mean  # the LP sees loads around 1
    experts, gpus = np.nonzero(member)
    model = mathopt.Model(name="weighted_shares")
    flow = [model.add_variable(lb=0.0, ub=float(scaled[e])) for e in experts.tolist()]
    max_load = model.add_variable(lb=0.0, name="T")
    for e in range(member.shape[0]):
        model.add_linear_constraint(mathopt.fast_sum(flow[n] for n in np.flatnonzero(experts == e)) == scaled[e])
    for g in range(member.shape[1]):
        model.add_linear_constraint(mathopt.fast_sum(flow[n] for n in np.flatnonzero(gpus == g)) <= max_load)
    model.minimize(max_load)
    result = mathopt.solve(model, mathopt.SolverType.GLOP)
    if result.termination.reason != mathopt.TerminationReason.OPTIMAL:
        return None
    values = np.clip(np.array(result.variable_values(flow), dtype=np.float64), 0.0, None)
    amounts = np.zeros(member.shape)
    amounts[experts, gpus] = values
    totals = amounts.sum(axis=1, keepdims=True)
    uniform = member / np.maximum(member.sum(axis=1, keepdims=True), 1)
    return np.asarray(np.where(totals > 0, amounts / np.where(totals > 0, totals, 1.0), uniform))


def exact_shares(data: LayerData, state: State) -> FloatArray:
    """``[E, G]`` shares for the output, in floats: the best (exactly evaluated) of the state's integer
    units, uniform shares and the LP's shares on the same placement, so a weighted answer is never worse
    than uniform shares on its placement."""
    candidates = [state_shares(data, state), state_shares(replace(data, split="uniform"), state)]
    by_lp = lp_shares(data.w, state.member)
    if by_lp is not None:
        candidates.append(by_lp)
    return min(candidates, key=lambda shares: float((data.w @ shares).max()))


def returned_max_load(data: LayerData, state: State) -> float:
    """Max GPU load of a state as it will be returned (weighted: with `exact_shares`), tokens."""
    if data.split == "uniform":
        return float(true_loads(data, state).max())
    return float((data.w @ exact_shares(data, state)).max())


def with_split_of(data: LayerData, state: State, search: LayerData) -> State:
    """A state found on ``search``'s (uniform) loads as a state of ``data``: LP shares when the layer is
    weighted and they lower the max load."""
    if data.split == search.split:
        return state
    uniform = state_from(data, state.member)
    shares = lp_shares(data.w, state.member)
    if shares is None:
        return uniform
    weighted = state_from(data, state.member, shares)
    return weighted if true_loads(data, weighted).max() <= true_loads(data, uniform).max() else uniform
