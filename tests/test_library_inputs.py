"""The Python library as users embed it: `eplb.solve.solve` / `evaluate`, `Cluster`, `Options`, the registry and
`eplb.replay` take lists, tuples and numpy integers, and refuse what is no input with one EplbError (or the
registry's SolverError) naming the argument, before any compiled kernel runs: never a crash, a traceback from
numpy or a silent wrong answer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from eplb.errors import EplbError
from eplb.placement import Placement
from eplb.solve import Cluster, evaluate, solve
from solvers import registry
from solvers.registry import Options, Problem, SolverError

RNG = np.random.default_rng(7)
LOADS = RNG.integers(1, 100, (2, 8)).astype(np.float64)
CLUSTER = Cluster(np.full(4, 3))


def _placement() -> Placement:
    return solve(LOADS, CLUSTER).placement


def test_huge_finite_loads_are_refused_before_the_greedy_kernel_runs() -> None:
    """1.7e308 (finite, but its sums are not) aborted the process in the greedy C kernel (free(): invalid pointer);
    the library's solve refuses it by the CLI's and the service's rule, and registry.solve does for every solver.
    In a child process, so that a crash fails this test instead of ending the run."""
    script = textwrap.dedent("""
        import numpy as np
        from eplb.errors import EplbError
        from eplb.solve import Cluster, solve
        from solvers import registry
        loads = np.full((1, 8), 1.7e308)
        loads[0, 0] = 1e300
        try:
            solve(loads, Cluster(np.full(4, 3)))
        except EplbError as exc:
            print("solve:", exc)
        for name in registry.names():
            try:
                registry.solve(name, registry.Problem(loads, np.full(4, 3)))
            except registry.SolverError as exc:
                print(f"{name}:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rule = "larger than any token count (limit 1e+15); scale the window down, only the ratios matter for placement"
    assert lines[0] == f"solve: loads[0][0] is 1e+300: {rule}"
    assert lines[1:] == [f"{name}: loads[0][0] is 1e+300: {rule}" for name in registry.names()]


def test_the_registry_checks_scenarios_and_coactivation_by_the_same_rule() -> None:
    loads = LOADS[:1]
    with pytest.raises(SolverError, match=r"^scenarios\[1\]\[0\]\[2\] is inf: loads must be finite numbers$"):
        scenarios = np.stack([loads, loads])
        scenarios[1, 0, 2] = np.inf
        registry.solve("greedy", Problem(loads, np.full(4, 3), scenarios=scenarios), Options(robust=True))
    pairs = np.zeros((1, 8, 8))
    pairs[0, 1, 1] = -1
    with pytest.raises(SolverError, match=r"^coactivation\[0\]\[1\]\[1\] is -1.0: loads must be >= 0$"):
        registry.solve("greedy-coact", Problem(loads, np.full(4, 3), coactivation=pairs))
    with pytest.raises(SolverError, match=r"^slots_per_gpu must hold whole slot counts, got dtype float64$"):
        registry.solve("greedy", Problem(loads, np.full(4, 3.5)))
    listed = registry.solve("greedy", Problem(loads.tolist(), [3, 3, 3, 3]))  # type: ignore[arg-type]  # as arrays
    assert np.array_equal(listed.phy2log, registry.solve("greedy", Problem(loads, np.full(4, 3))).phy2log)


@pytest.mark.parametrize(("value", "message"), [
    (np.nan, "loads[0][3] is nan: loads must be finite numbers"),
    (np.inf, "loads[0][3] is inf: loads must be finite numbers"),
    (-5.0, "loads[0][3] is -5: loads must be >= 0"),
    (2e15, "loads[0][3] is 2000000000000000: larger than any token count (limit 1e+15)"),
])
def test_evaluate_and_solve_refuse_what_is_no_load(value: float, message: str) -> None:
    """evaluate gave lb [nan, ...] for NaN and inf, and a plausible lb for a negative load, without a word."""
    placement = _placement()
    bad = LOADS.copy()
    bad[0, 3] = value
    calls: list[Callable[[], object]] = [lambda: evaluate(bad, placement), lambda: solve(bad, CLUSTER)]
    for call in calls:
        with pytest.raises(EplbError) as info:
            call()
        assert str(info.value).startswith(message)


@pytest.mark.parametrize(("loads", "message"), [
    (LOADS[0], "loads must be [layers][experts]; got one row of 8 numbers (wrap a single layer in another list)"),
    (np.zeros((3, 0)), "loads is empty: a window holds at least one layer of the model's experts, one count per "
                       "expert ([layers][experts]; got shape [3, 0])"),
    (np.zeros((0, 8)), "loads is empty: a window holds at least one layer of the model's experts, one count per "
                       "expert ([layers][experts]; got shape [0, 8])"),
    (LOADS.astype(str), "loads must be numbers in a [layers][experts] array"),
    (np.array([[1, "a"] * 4, [2, 3] * 4], dtype=object), "loads must be numbers in a [layers][experts] array"),
    (LOADS + 1j, "loads must hold real numbers (integers or floats), got dtype complex128"),
    (LOADS > 50, "loads must hold real numbers (integers or floats), got dtype bool"),
])
def test_loads_of_another_shape_or_type_are_refused_by_name(loads: Any, message: str) -> None:
    """1-D loads raised IndexError, [3, 0] a message about negative list elements, object and str dtypes a TypeError
    from isfinite; complex loads lost their imaginary part (a complex lb), and 0 layers solved into a placement file
    that could not be read back."""
    calls: list[Callable[[], object]] = [lambda: solve(loads, CLUSTER), lambda: evaluate(loads, _placement())]
    for call in calls:
        with pytest.raises(EplbError) as info:
            call()
        assert str(info.value) == message
