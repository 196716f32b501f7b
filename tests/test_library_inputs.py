"""The Python library as users embed it: `eplb.solve.solve` / `evaluate`, `Cluster`, `Options`, the registry and
`eplb.replay` take lists, tuples and numpy integers, and refuse what is no input with one EplbError (or the
registry's SolverError) naming the argument, before any compiled kernel runs: never a crash, a traceback from
numpy or a silent wrong answer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.io.logs import write_log
from eplb.placement import Placement, load_placement
from eplb.replay import Schedule, replay
from eplb.solve import Cluster, evaluate, solve
from solvers import registry
from solvers.registry import Options, Problem, SolverError

RNG = np.random.default_rng(7)
LOADS = RNG.integers(1, 100, (2, 8)).astype(np.float64)
CLUSTER = Cluster(np.full(4, 3))
COUNTS = RNG.integers(0, 50, (30, 2, 8))


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
        from solvers.greedy import rebalance_experts, solve_greedy
        for entry, call in (("solve_greedy", lambda: solve_greedy(loads, np.full(4, 3))),
                            ("rebalance_experts", lambda: rebalance_experts(loads, 12, 1, 1, 4))):
            try:  # the solvers' own entry points, as the engine plug-ins and DeepSeek's drop-in call them
                call()
            except ValueError as exc:
                print(f"{entry}:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rule = ("larger than any token count (limit 1e+15); scale the window down, a placement follows the loads' ratios, "
            "up to rounding")
    assert lines[0] == f"solve: loads[0][0] is 1e+300: {rule}"
    names = registry.names()
    assert lines[1 : 1 + len(names)] == [f"{name}: loads[0][0] is 1e+300: {rule}" for name in names]
    assert lines[1 + len(names)] == f"solve_greedy: loads[0][0] is 1e+300: {rule}"
    assert lines[2 + len(names)].startswith("rebalance_experts: weight[0][0] is inf")  # float32, as DeepSeek's


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


def test_lists_tuples_and_numpy_integers_are_taken_where_users_pass_them() -> None:
    """solve(list_of_lists, ...), evaluate(list, ...), Cluster([5, 5, 5, 5]) / a tuple / numpy ints raised
    AttributeError."""
    reference = solve(LOADS, CLUSTER)
    for slots in ([3, 3, 3, 3], (3, 3, 3, 3), [np.int64(3)] * 4, np.full(4, 3.0), np.full(4, 3, dtype=np.uint8)):
        cluster = Cluster(slots)
        assert cluster.slots_per_gpu.dtype == np.int64 and cluster.slots_per_gpu.tolist() == [3, 3, 3, 3]
        outcome = solve(LOADS.tolist(), cluster)
        assert np.array_equal(outcome.placement.phy2log, reference.placement.phy2log)
    judged = evaluate(LOADS.tolist(), reference.placement)
    assert np.allclose(judged.balance.lb, reference.balance.lb)
    nodes = Cluster([3, 3, 3, 3], gpus_per_node=np.int64(2), num_groups=np.int32(2))
    assert (type(nodes.gpus_per_node), type(nodes.num_groups)) == (int, int)
    assert solve(LOADS, nodes).placement.num_gpus == 4
    budget = Options(max_moves=np.int64(3))  # type: ignore[arg-type]
    assert type(budget.max_moves) is int
    moved = solve(LOADS[::-1].copy(), CLUSTER, current=reference.placement, options=budget)
    assert moved.moves is not None and int(moved.moves.sum()) <= 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int64"])
def test_tensors_of_every_dtype_are_read_as_their_values(dtype: str) -> None:
    """A bfloat16 tensor (numpy has no bfloat16) was 'loads must be numbers in a [layers][experts] array' in solve
    and a TypeError in evaluate, where float16 worked."""
    import torch

    tensor = torch.tensor(LOADS).to(getattr(torch, dtype))
    values = tensor.double().numpy()
    reference = solve(values, CLUSTER)
    outcome = solve(tensor, CLUSTER)
    assert np.array_equal(outcome.placement.phy2log, reference.placement.phy2log)
    assert np.allclose(evaluate(tensor, reference.placement).balance.lb, reference.balance.lb)
    meta = tensor.to("meta")
    calls: list[Callable[[], object]] = [lambda: solve(meta, CLUSTER), lambda: evaluate(meta, reference.placement)]
    for call in calls:
        with pytest.raises(EplbError, match=r"^loads is a tensor on the meta device, which holds no values$"):
            call()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Cluster(np.array([3.7, 3.2])), "slots_per_gpu[0] is 3.7: slot counts are whole numbers"),
    (lambda: Cluster([3, 0]), "slots_per_gpu[1] is 0: every GPU needs at least one slot"),
    (lambda: Cluster(np.ones((2, 2))), "slots_per_gpu must list one slot count per GPU (a 1-D list of at least one), "
                                       "got shape [2, 2]"),
    (lambda: Cluster([]), "slots_per_gpu must list one slot count per GPU (a 1-D list of at least one), got shape [0]"),
    (lambda: Cluster([True, True]), "slots_per_gpu must hold real numbers (integers or floats), got dtype bool"),
    (lambda: Cluster(np.ones(65_537)), "slots_per_gpu lists 65,537 GPUs: at most 65,536"),
    (lambda: Cluster([10**12]), "slots_per_gpu[0] is 1000000000000: more slots than any GPU holds (at most "
                                "2,147,483,647)"),
    (lambda: Cluster([2, 2], gpus_per_node=2.0),  # type: ignore[arg-type]
     "gpus_per_node must be a whole number (an int), got 2.0"),
    (lambda: Cluster([2, 2], num_groups="2"),  # type: ignore[arg-type]
     "num_groups must be a whole number (an int), got '2'"),
])
def test_a_cluster_that_is_none_is_refused_naming_the_field(make: Callable[[], Cluster], message: str) -> None:
    """Cluster(np.array([3.7, 3.2])) was truncated to 3, 3 without a word; gpus_per_node=2.0 raised a TypeError
    (floats are refused, as the CLI's --gpus-per-node 2.0 is)."""
    with pytest.raises(EplbError) as info:
        make()
    assert str(info.value) == message


@pytest.mark.parametrize(("options", "message"), [
    (Options(max_moves=2.5),  # type: ignore[arg-type]
     "max_moves must be a whole number of expert copies, got 2.5"),
    (Options(max_moves=10**30), f"max_moves must be at most 10,000,000 expert copies, got {10**30:,}"),
    (Options(max_moves_per_layer=-1), "max_moves_per_layer must be >= 0, got -1"),
    (Options(max_moves_per_layer=np.int64(1_000_001)),  # type: ignore[arg-type]
     "max_moves_per_layer must be at most 1,000,000 expert copies, got 1,000,001"),
    (Options(target_lb="1.1"),  # type: ignore[arg-type]
     "target_lb must be >= 1 (lb = busiest GPU / mean GPU), got '1.1'"),
    (Options(robust="yes"), "robust must be True or False, got 'yes'"),  # type: ignore[arg-type]
])
def test_options_that_are_none_are_one_line_errors(options: Options, message: str) -> None:
    """Options(max_moves=2.5) raised a TypeError from inside the incremental solver."""
    with pytest.raises(EplbError) as info:
        solve(LOADS, CLUSTER, current=_placement(), options=options)
    assert str(info.value) == message


def test_a_cluster_beyond_the_window_is_refused_before_it_is_allocated() -> None:
    """slots_per_gpu of 1e12 raised MemoryError (14.6 TiB); a GPU never needs more slots than there are experts,
    the CLI's and the service's rule."""
    with pytest.raises(EplbError, match=r"^1,000,000,000 slots on one GPU but only 8 experts: a GPU never needs"):
        solve(LOADS, Cluster([10**9]))


def test_an_empty_or_unknown_solver_name_is_refused_naming_the_registered_ones() -> None:
    """solver="" silently ran greedy."""
    for name in ("", "gredy"):
        with pytest.raises(EplbError) as info:
            solve(LOADS, CLUSTER, solver=name)
        assert str(info.value) == f"unknown solver {name!r}: choose one of {', '.join(registry.names())}"


def test_the_default_redundancy_is_what_one_gpu_allows(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      server_factory: Callable[..., str]) -> None:
    """`eplb solve --gpus 1` and POST /placement with cluster {"num_gpus": 1} were refused ('1 redundant experts put
    more than 4 slots ... give at most 0') though no redundancy was asked for; the default is what the cluster
    allows (none on one GPU), and an explicit one is still refused."""
    window = tmp_path / "w4.json"
    window.write_text(json.dumps({"loads": [[5, 1, 2, 8], [3, 3, 0, 1]]}))
    out = tmp_path / "p.json"
    assert main(["solve", "--loads", str(window), "--gpus", "1", "--out", str(out)]) == 0
    assert "1 GPU, 4 slots each" in capsys.readouterr().out
    assert load_placement(out).slots_per_gpu.tolist() == [4]
    assert main(["solve", "--loads", str(window), "--gpus", "1", "--redundant", "1"]) == 2
    assert "--redundant: 1 redundant expert puts more than 4 slots (one per expert) on the one GPU: give at most 0" \
        in capsys.readouterr().err
    base = server_factory()
    body: dict[str, Any] = {"loads": [[5, 1, 2, 8], [3, 3, 0, 1]], "cluster": {"num_gpus": 1}}
    r = httpx.post(f"{base}/placement", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["placement"]["slots_per_gpu"] == [4]
    r = httpx.post(f"{base}/placement", json={**body, "cluster": {"num_gpus": 1, "num_redundant": 1}}, timeout=60)
    assert r.status_code == 422 and "give at most 0 redundant experts" in r.text


def test_a_schedule_takes_numpy_integers() -> None:
    """Schedule(window=np.int64(10), interval=np.int64(10)) was refused ('must be a whole number of steps >= 1, got
    np.int64(10)'); it reads them as ints (its to_dict is JSON), and still refuses floats and bools by name."""
    schedule = Schedule(window=np.int64(10), interval=np.int64(10), delay=np.int32(1))  # type: ignore[arg-type]
    result = replay(COUNTS, CLUSTER, schedule=schedule)
    assert json.dumps(schedule.to_dict())
    assert result.rebalances and result.rebalances[0].position == 10
    floats = Schedule(window=10.0)  # type: ignore[arg-type]
    for field, refused in (("window", floats), ("interval", Schedule(interval=True))):
        value = getattr(refused, field)
        with pytest.raises(EplbError, match=rf"^{field} must be a whole number of steps >= 1, got {value!r}$"):
            refused.check()


@pytest.mark.parametrize("counts", [COUNTS > 20, COUNTS.astype(object)], ids=["bool", "object"])
def test_counts_of_no_count_type_are_named_by_their_type(counts: Any, tmp_path: Path) -> None:
    """Bool counts said 'count is 0; counts must be whole numbers', object counts 'count is 47; ...'."""
    kind = counts.dtype
    with pytest.raises(EplbError) as info:
        replay(counts, CLUSTER, schedule=Schedule(window=10, interval=10))
    assert str(info.value) == f"<array>: counts have dtype {kind}, not a count type: give integers (or whole floats)"
    with pytest.raises(EplbError) as info:
        write_log(tmp_path / "log.npz", counts)
    assert str(info.value) == f"counts: counts have dtype {kind}, not a count type: give integers (or whole floats)"


def test_chunks_of_other_experts_say_which_chunk_has_how_many(tmp_path: Path) -> None:
    """Chunks with different E raised numpy's concatenate ValueError."""
    def chunks() -> Any:
        return iter([COUNTS[:5], COUNTS[5:12, :, :6]])

    why = ("counts chunk 1 (from step position 5) has 2 layers x 6 experts, chunk 0 has 2 layers x 8 experts: every "
           "chunk holds the same layers and experts")
    with pytest.raises(EplbError) as info:
        replay(chunks(), CLUSTER, schedule=Schedule(window=3, interval=3), hindsight=False)
    assert str(info.value) == f"<array>: {why}"
    with pytest.raises(EplbError) as info:
        write_log(tmp_path / "log.npz", chunks(), num_steps=12)
    assert str(info.value) == why


def test_a_weighted_solver_asked_for_with_the_weighted_split_is_itself() -> None:
    """`milp-weighted` with split weighted said 'the milp-weighted solver gives uniform shares only'."""
    from eplb.solve import solver_name

    assert solver_name("milp-weighted", "weighted") == solver_name("milp", "weighted") == "milp-weighted"
    assert solver_name("milp-weighted") == "milp-weighted"


def test_a_solve_from_a_placement_keeps_its_model_layers() -> None:
    """eplb.solve.solve against a current placement with layer_ids returns them: its export keys the same model
    layers (the result had none, so a TensorRT-LLM export keyed 0..L-1)."""
    from eplb.io.exports import export_text
    from eplb.placement import Placement
    from eplb.solve import Cluster, solve
    from solvers.greedy import solve_greedy

    slots = np.full(4, 5, dtype=np.int64)
    loads = np.random.default_rng(2).gamma(0.5, 100, (2, 16))
    current = Placement(solve_greedy(loads[::-1].copy(), slots), slots, 16, layer_ids=(3, 4))
    for solver in ("greedy", "incremental"):
        out = solve(loads, Cluster(slots), solver=solver, current=current)
        assert out.placement.layer_ids == (3, 4)
        assert "3:" in export_text(out.placement, "trtllm") and "\n  0:" not in export_text(out.placement, "trtllm")


def test_a_target_lb_or_a_move_budget_without_the_serving_placement_names_itself_and_how_to_give_it() -> None:
    """The registry called --target-lb 'a move budget' and said 'give the current one' / 'give the current
    placement', naming no argument: a library caller is told the Problem's field, `eplb.solve.solve`'s caller its
    `current` argument."""
    slots = np.full(4, 3, dtype=np.int64)
    cases = [
        (Options(target_lb=1.05), "target_lb: a target lb needs the serving placement, whose edits it bounds"),
        (Options(max_moves=3), "max_moves: a move budget needs the serving placement, whose edits it bounds"),
        (Options(max_moves=3, max_moves_per_layer=1),
         "max_moves, max_moves_per_layer: move budgets need the serving placement, whose edits they bound"),
        (Options(max_moves=3, target_lb=1.05),
         "max_moves, target_lb: a move budget and a target lb need the serving placement, whose edits they bound"),
    ]
    for options, said in cases:
        with pytest.raises(SolverError) as refused:
            registry.check("greedy", Problem(LOADS, slots), options)
        assert str(refused.value) == f"{said}: give it as Problem(current_phy2log=...)"
        with pytest.raises(EplbError) as raised:
            solve(LOADS, Cluster(slots), options=options)
        assert str(raised.value) == f"{said}: give it as solve(current=...)"
    with pytest.raises(SolverError) as refused:
        registry.check("incremental", Problem(LOADS, slots), Options())
    assert str(refused.value) == "solver 'incremental' rebalances a serving placement: give it as " \
                                 "Problem(current_phy2log=...)"
    with pytest.raises(EplbError) as raised:
        solve(LOADS, Cluster(slots), solver="incremental", options=Options(target_lb=1.05))
    assert str(raised.value) == "solver 'incremental' rebalances a serving placement: give it as solve(current=...)"
