"""One table of placement solvers and rebalancing policies.

Every solver is a subclass of `Solver` that says what it can do (`Capabilities`) and which options it
reads, and is registered here once by name. The CLI, the API, replay and reports list and dispatch
through `get_solver` / `solve`; an option or input a solver cannot honour is refused in `check`, the one
place that does it. Modelled on vLLM's `AbstractEplbPolicy` and its policy table.

Adding a solver is one new module with a `Solver` subclass plus one `register(...)` line at the end of
this file (modules are imported lazily, so the MILP's OR-Tools loads only when it is used).
"""

from __future__ import annotations

import importlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from solvers.validation import real_number, refuse_loads, validate_placement, whole_number

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class Problem:
    """One placement problem, every array indexed by layer first.

    loads: [L, E] tokens per logical expert over the window; slots_per_gpu: [G] slots per GPU;
    num_groups, gpus_per_node: the hierarchical policy (expert groups kept within nodes) when both are set;
    current_phy2log: [L, P] the placement being served (migration-aware and incremental solvers use it);
    scenarios: [S, L, E] recent sub-windows (robust objectives), None for the window alone;
    coactivation: [L, E, E] tokens that chose both experts (co-activation-aware solvers), or None.
    """

    loads: FloatArray
    slots_per_gpu: IntArray
    num_groups: int | None = None
    gpus_per_node: int | None = None
    current_phy2log: IntArray | None = None
    scenarios: FloatArray | None = None
    coactivation: FloatArray | None = None

    def __post_init__(self) -> None:
        """Lists and tuples become arrays (the solvers index them); `check` judges the values."""
        for name in ("loads", "slots_per_gpu", "current_phy2log", "scenarios", "coactivation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, np.ndarray):
                object.__setattr__(self, name, np.asarray(value))

    @property
    def hierarchical(self) -> bool:
        return self.num_groups is not None and self.gpus_per_node is not None


@dataclass(frozen=True)
class Options:
    """Knobs a solver may read; `Solver.options` names the ones it honours (others must stay at default).

    time_limit_s: per layer, s; total_time_limit_s: whole call, s; max_lb_slack: relative lb a
    migration-aware solve may give up for fewer copies; max_moves: expert copies allowed in the whole
    model; max_moves_per_layer: the same per layer; target_lb: stop moving once every layer reaches it;
    robust: after any solver, swap slots so the placement holds up on every scenario (`solvers.robust`).
    """

    time_limit_s: float | None = None
    total_time_limit_s: float | None = None
    max_lb_slack: float = 0.01
    max_moves: int | None = None
    max_moves_per_layer: int | None = None
    target_lb: float | None = None
    robust: bool = False

    def __post_init__(self) -> None:
        """A numpy integer move budget reads as an int; `check_options` refuses what is no count."""
        for name in ("max_moves", "max_moves_per_layer"):
            count = whole_number(getattr(self, name))
            if count is not None:
                object.__setattr__(self, name, count)

    def set_names(self) -> list[str]:
        """Names of the options that differ from their defaults."""
        default = Options()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@dataclass(frozen=True)
class Capabilities:
    """hierarchical: honours group-to-node locality; hierarchical_with_current: honours it with a serving
    placement given too (False: the hierarchical policy only without one, as the MILP, whose migration mode
    does not keep groups within nodes); uneven_slots: GPUs may have different slot counts;
    current: uses the serving placement; requires_current: cannot run without it; shares: may return
    weighted shares; aligned: its output is already labelled to overlap the serving placement (no GPU
    relabelling afterwards); ep_beyond_experts: handles more GPUs than experts; coactivation: needs
    `Problem.coactivation`."""

    hierarchical: bool = False
    hierarchical_with_current: bool = True
    uneven_slots: bool = True
    current: bool = False
    requires_current: bool = False
    shares: bool = False
    aligned: bool = False
    ep_beyond_experts: bool = True
    coactivation: bool = False


@dataclass
class Solution:
    """What a solver returns. phy2log: [L, P]; shares: [L, P] or None (uniform); status: overall word
    (optimal, feasible, time_limit, heuristic, greedy_fallback); layer_status: per layer or None;
    layer_ms: [L] wall ms per layer; bound_tokens: [L] proven lower bound on the busiest GPU's load, or
    None; info: anything else the solver reports (JSON-ready)."""

    phy2log: IntArray
    shares: FloatArray | None = None
    status: str = "heuristic"
    layer_status: list[str] | None = None
    layer_ms: list[float] | None = None
    bound_tokens: FloatArray | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Solver(ABC):
    """A placement solver or rebalancing policy: arrays in, a validated `Solution` out."""

    name: ClassVar[str]
    summary: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()
    options: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def solve(self, problem: Problem, options: Options) -> Solution:
        """Place every layer of `problem`; `check` has already accepted the inputs."""


class SolverError(ValueError):
    """A solver name, option or input combination that cannot be honoured; the message says what to change.
    options: the `Options` fields the refusal is about, when it is about some (`check_options`), so a caller
    names those fields and no other."""

    def __init__(self, message: str, options: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.options: tuple[str, ...] = tuple(options)


MAX_MOVES = 10_000_000
"""The most expert copies a move budget may allow in the whole model (`Options.max_moves`: the Python API, the CLI's
--max-moves, the service's max_moves); per layer, MAX_MOVES_PER_LAYER."""
MAX_MOVES_PER_LAYER = 1_000_000

EVERY_SOLVER = frozenset({"robust"})
"""Options every solver takes: the registry applies them after the solver (`solve`)."""
BUDGET_OPTIONS = ("max_moves", "max_moves_per_layer", "target_lb")
"""Options that bound the copies from the serving placement: they need it (`Problem.current_phy2log`)."""

_TABLE: dict[str, str] = {}
_LOADED: dict[str, type[Solver]] = {}


def register(name: str, target: str) -> None:
    """Register solver `name` as "module:Class" (imported on first use)."""
    if name in _TABLE:
        raise ValueError(f"solver {name!r} is registered twice")
    _TABLE[name] = target


def names() -> list[str]:
    """Registered solver names, in registration order."""
    return list(_TABLE)


def get_solver(name: str) -> type[Solver]:
    """The solver class registered as `name`; SolverError naming the choices otherwise."""
    if name not in _TABLE:
        raise SolverError(f"unknown solver {name!r}: choose one of {', '.join(_TABLE)}")
    if name not in _LOADED:
        module, cls_name = _TABLE[name].split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, Solver)) or cls.name != name:
            raise TypeError(f"{_TABLE[name]} is not a Solver named {name!r}")
        _LOADED[name] = cls
    return _LOADED[name]


def check_options(
    name: str, options: Options, has_current: bool, names: Mapping[str, str] | None = None
) -> type[Solver]:
    """Refuse the options solver `name` does not take or cannot honour (a move budget or a target lb without the
    serving placement, values out of range); the SolverError's `options` are the ones refused. names: what the
    messages call each option (the CLI: its flags, `eplb.cli.solve.OPTION_FLAGS`; the API: its fields,
    `api.convert.OPTION_FIELDS`), and then the options a refusal offers are those it names (the caller has no
    way to give the others); by default every option, by its own name; names['current_phy2log'] says how the
    caller gives the serving placement (by default `SERVING`, the Problem's field). Returns the solver class."""
    cls = get_solver(name)

    def n(option: str) -> str:
        return option if names is None else names.get(option, option)

    unsupported = [o for o in options.set_names() if o not in cls.options and o not in EVERY_SOLVER]
    budget = [o for o in unsupported if o in BUDGET_OPTIONS]
    if budget and not has_current:  # a target lb is no move budget: it says where the edits may stop
        moves = sum(o != "target_lb" for o in budget)
        kinds = [*(["a move budget" if moves == 1 else "move budgets"] if moves else []),
                 *(["a target lb"] if "target_lb" in budget else [])]
        one = kinds in (["a move budget"], ["a target lb"])
        raise SolverError(f"{', '.join(map(n, budget))}: {' and '.join(kinds)} {'needs' if one else 'need'} the "
                          f"serving placement, whose edits {'it bounds' if one else 'they bound'}{_give(names)}",
                          budget)
    if unsupported:
        offered = {n(o) for o in cls.options if names is None or o in names}
        takes = ", ".join(sorted(offered)) or "none"
        raise SolverError(f"solver {name!r} does not take {', '.join(map(n, unsupported))} (it takes: {takes})",
                          unsupported)
    for opt in ("time_limit_s", "total_time_limit_s"):
        value = getattr(options, opt)
        if value is not None and not (real_number(value) and math.isfinite(value) and value > 0):
            raise SolverError(f"{n(opt)} must be a positive number, got {value!r}", [opt])
    target = options.target_lb
    if target is not None and not (real_number(target) and math.isfinite(target) and target >= 1):
        raise SolverError(f"{n('target_lb')} must be >= 1 (lb = busiest GPU / mean GPU), got {target!r}", ["target_lb"])
    if not (real_number(options.max_lb_slack) and math.isfinite(options.max_lb_slack) and options.max_lb_slack >= 0):
        raise SolverError(f"{n('max_lb_slack')} must be >= 0, got {options.max_lb_slack!r}", ["max_lb_slack"])
    for opt, most in (("max_moves", MAX_MOVES), ("max_moves_per_layer", MAX_MOVES_PER_LAYER)):
        value = getattr(options, opt)
        if value is None:
            continue
        if whole_number(value) is None:
            raise SolverError(f"{n(opt)} must be a whole number of expert copies, got {value!r}", [opt])
        if value < 0:
            raise SolverError(f"{n(opt)} must be >= 0, got {value!r}", [opt])
        if value > most:
            raise SolverError(f"{n(opt)} must be at most {most:,} expert copies, got {value:,}", [opt])
    if not isinstance(options.robust, bool | np.bool_):
        raise SolverError(f"{n('robust')} must be True or False, got {options.robust!r}", ["robust"])
    return cls


SERVING = "Problem(current_phy2log=...)"
"""How a caller of the registry gives the serving placement, for the refusals that ask for it (a caller names its
own way as names['current_phy2log']: the API's current_placement, `eplb.solve.solve`'s current argument)."""


def _give(names: Mapping[str, str] | None) -> str:
    """': give it as X', X how the caller gives the serving placement (names['current_phy2log'], by default
    `SERVING`); '' for a caller whose names say nothing of it."""
    where = SERVING if names is None else names.get("current_phy2log")
    return "" if where is None else f": give it as {where}"


def check_current_given(name: str, has_current: bool, names: Mapping[str, str] | None = None) -> None:
    """SolverError for solver `name`, which rebalances a serving placement, without one (names: as
    `check_options`, names['current_phy2log'] how the caller gives it)."""
    if not has_current and get_solver(name).capabilities.requires_current:
        give = _give(names) or ": give the current placement"
        raise SolverError(f"solver {name!r} rebalances a serving placement{give}")


def _group_names(names: Mapping[str, str] | None) -> str:
    """What to drop for the hierarchical policy: by default the CLI's --groups/--gpus-per-node."""
    return "/".join((names or {}).get(k, flag) for k, flag in (("num_groups", "--groups"),
                                                               ("gpus_per_node", "--gpus-per-node")))


def check(name: str, problem: Problem, options: Options, names: Mapping[str, str] | None = None) -> type[Solver]:
    """Refuse, in one place, every input or option the solver cannot honour (`check_options` first; `names`
    as there, and `num_groups` / `gpus_per_node` for the groups a solver cannot keep within nodes: by default
    the CLI's --groups/--gpus-per-node; `current_phy2log` for the serving placement a solver cannot take with
    them: by default the CLI's --current; a mapping without it offers no dropping of it, as a deployment,
    whose every rebalance starts from one, cannot). Returns the solver class."""
    cls = check_options(name, options, problem.current_phy2log is not None, names)
    caps = cls.capabilities
    loads, slots = problem.loads, problem.slots_per_gpu
    if loads.ndim != 2 or 0 in loads.shape:
        raise SolverError(f"loads must be [layers, experts] with at least one of each, got shape {list(loads.shape)}")
    for what, values in (("loads", loads), ("scenarios", problem.scenarios), ("coactivation", problem.coactivation)):
        try:  # token counts, finite and at most MAX_LOAD, before any compiled kernel sees them
            if values is not None:
                refuse_loads(values, what)
        except ValueError as exc:
            raise SolverError(str(exc)) from None
    if slots.dtype.kind not in "iu":
        raise SolverError(f"slots_per_gpu must hold whole slot counts, got dtype {slots.dtype}")
    if slots.ndim != 1 or slots.size == 0 or (slots < 1).any():
        raise SolverError("every GPU needs at least one slot")
    num_experts = loads.shape[1]
    if int(slots.sum()) < num_experts:
        raise SolverError(
            f"{int(slots.sum())} slots on {slots.size} GPUs cannot hold {num_experts} experts: need at least "
            f"{-(-num_experts // slots.size)} slots per GPU"
        )
    if not caps.uneven_slots and np.unique(slots).size > 1:
        raise SolverError(f"solver {name!r} needs the same slot count on every GPU")
    if not caps.ep_beyond_experts and slots.size > num_experts:
        raise SolverError(f"solver {name!r} needs at most {num_experts} GPUs ({slots.size} given)")
    if problem.hierarchical and not caps.hierarchical:
        drop = _group_names(names)
        raise SolverError(
            f"solver {name!r} does not keep expert groups within nodes: drop {drop} "
            f"or choose one of {', '.join(n for n in _TABLE if get_solver(n).capabilities.hierarchical)}"
        )
    if problem.hierarchical and problem.current_phy2log is not None and not caps.hierarchical_with_current:
        both = [n for n in _TABLE if (c := get_solver(n).capabilities).hierarchical and c.hierarchical_with_current
                and c.current]  # keep groups within nodes and take (not merely accept) the serving placement
        drop = _group_names(names)
        current = "--current" if names is None else names.get("current_phy2log")
        if current is not None:
            drop = f"{drop} or {current}"
        raise SolverError(
            f"solver {name!r} keeps expert groups within nodes or minimizes copies from a current placement, not "
            f"both: drop {drop}, or choose a solver that does both ({', '.join(both)})"
        )
    if options.robust and (problem.scenarios is None or problem.scenarios.shape[1:] != loads.shape):
        raise SolverError("robust needs scenarios: [S, layers, experts] recent sub-windows of the loads")
    pairs = problem.coactivation
    if caps.coactivation and (pairs is None or pairs.shape != (loads.shape[0], num_experts, num_experts)):
        raise SolverError(f"solver {name!r} needs co-activation pair counts [layers, E, E] in Problem.coactivation "
                          "(eplb.solve fills them from the window's co-activation summary)")
    check_current_given(name, problem.current_phy2log is not None, names)
    return cls


def applicable(name: str, options: Options) -> Options:
    """`options` without the ones solver `name` does not take: for settings shared by several solvers
    (a compare run's time limit applies to the MILP, not to greedy)."""
    taken = get_solver(name).options
    return replace(options, **{o: getattr(Options(), o) for o in options.set_names() if o not in taken})


def solve(name: str, problem: Problem, options: Options | None = None) -> Solution:
    """Check, run and validate solver `name` on `problem`. Fills layer_ms when the solver does not."""
    options = options or Options()
    cls = check(name, problem, options)
    started = time.perf_counter()
    solution = cls().solve(problem, options)
    if options.robust:
        from solvers.robust import refine

        solution = refine(problem, solution, options)
    validate_placement(solution.phy2log, problem.slots_per_gpu, problem.loads.shape[1], solution.shares)
    if solution.layer_ms is None:
        layers = problem.loads.shape[0]
        per_layer = (time.perf_counter() - started) * 1000 / max(layers, 1)
        solution.layer_ms = [round(per_layer, 3)] * layers
    return solution


# The table: one line per solver.
register("greedy", "solvers.greedy:GreedySolver")
register("deepseek", "solvers.greedy:DeepSeekSolver")
register("milp", "solvers.milp:MilpSolver")
register("milp-weighted", "solvers.milp:WeightedMilpSolver")
register("incremental", "solvers.incremental:IncrementalSolver")
register("greedy-coact", "solvers.coactivation:CoactGreedySolver")
