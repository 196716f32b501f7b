"""The vLLM policy plug-in: vLLM's interface in both return conventions, DeepSeek-equal fresh placements,
move budgets and slot keeping with the serving map, -1 slots, registration, and the service with fallback; in
remote mode, every EP rank calling the policy with one window gets one placement (one service, and two replicas on
PostgreSQL; tests/test_replicas.py has two replicas answering one window alike on a SQLite file and on PostgreSQL)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from eplb import retry
from eplb.deployments import NAME, check_name
from eplb.errors import EplbError
from eplb.integrations import core
from eplb.integrations import vllm as plugin
from eplb.integrations.vllm import EplbPolicy, policy_class
from eplb.io.windows import check_loads
from eplb.rules import DEPLOYMENT_NAME, is_deployment_name
from solvers import registry
from tests.conftest import remote_mixtral_deployment
from tests.db_fixtures import PostgresCluster, postgres_fixture  # noqa: F401
from tests.engine_ranks import run_ranks
from tests.flaky_proxy import proxy
from tests.test_replicas import replica

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "deepseek_eplb_golden.json").read_text())["cases"]
PREFILL = np.array(json.loads((ROOT / "fixtures" / "sglang6017-dsv3-prefill-in4096.json").read_text())["loads"])
DECODE = np.array(json.loads((ROOT / "fixtures" / "sglang6017-dsv3-decode-in1000out1000.json").read_text())["loads"])
CONVENTIONS = ["phy2log", "tuple"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("EPLB_")]:
        monkeypatch.delenv(name)
    core.forget_served()  # each test's engine starts with nothing answered
    monkeypatch.setattr(core, "_WARNED", set())  # nor anything warned


def call(convention: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the policy; return (phy2log, log2phy, logcnt) whatever the convention (derived for phy2log)."""
    out = policy_class(convention).rebalance_experts(*args)  # type: ignore[arg-type]
    if convention == "tuple":
        assert isinstance(out, tuple) and len(out) == 3
        return out
    assert isinstance(out, torch.Tensor)
    log2phy, logcnt = core.logical_maps(out.numpy(), args[0].shape[1])
    return out, torch.from_numpy(log2phy), torch.from_numpy(logcnt)


def check_valid(phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_experts: int) -> None:
    """Every expert placed, counts agree with the map, log2phy points at slots of its expert."""
    p = phy2log.numpy()
    assert p.min() >= 0 and p.max() < num_experts
    for layer in range(p.shape[0]):
        assert np.array_equal(np.bincount(p[layer], minlength=num_experts), logcnt[layer].numpy())
        for e in range(num_experts):
            slots = log2phy[layer, e].numpy()
            slots = slots[slots >= 0]
            assert slots.size == logcnt[layer, e] and (p[layer, slots] == e).all()
    assert (logcnt >= 1).all()


# --- vLLM's interface -------------------------------------------------------------------------------


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_shapes_and_dtypes(convention: str) -> None:
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]] * 2, dtype=torch.int64)
    out = policy_class(convention).rebalance_experts(weight, 16, 4, 2, 8)  # type: ignore[arg-type]
    if convention == "phy2log":
        assert isinstance(out, torch.Tensor)
        assert out.shape == (2, 16) and out.dtype == torch.int64 and out.device.type == "cpu"
        return
    phy2log, log2phy, logcnt = out
    assert phy2log.shape == (2, 16) and logcnt.shape == (2, 12)
    assert log2phy.shape == (2, 12, int(logcnt.max()))
    assert {t.dtype for t in out} == {torch.int64} and {t.device.type for t in out} == {"cpu"}
    check_valid(phy2log, log2phy, logcnt, 12)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: f"{c['kind']}-{c['variant']}-{c['num_gpus']}")
def test_fresh_placement_equals_deepseek(convention: str, case: dict[str, Any]) -> None:
    weight = torch.tensor(case["weight"])
    args = (weight, case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
    out = policy_class(convention).rebalance_experts(*args)  # type: ignore[arg-type]
    if convention == "phy2log":
        assert out.tolist() == case["phy2log"]
    else:
        assert [t.tolist() for t in out] == [case["phy2log"], case["log2phy"], case["logcnt"]]


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_what_vllms_algorithm_tests_check(convention: str) -> None:
    # one GPU: every expert placed once
    phy2log, _, logcnt = call(convention, torch.tensor([[10, 20, 30, 40]]), 4, 1, 1, 1)
    assert sorted(phy2log[0].tolist()) == [0, 1, 2, 3]
    # equal loads, no redundancy: one replica each
    _, _, logcnt = call(convention, torch.full((1, 8), 50), 8, 2, 2, 4)
    assert (logcnt == 1).all()
    # one hot expert gets the redundant slots
    _, _, logcnt = call(convention, torch.tensor([[1000, 1, 1, 1, 1, 1, 1, 1]]), 12, 2, 2, 4)
    assert logcnt[0, 0] > logcnt[0, 1:].max()
    # several layers, replicas sum to the slots in each
    weight = torch.tensor([[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6])
    _, _, logcnt = call(convention, weight, 8, 2, 2, 4)
    assert logcnt.sum(dim=1).tolist() == [8, 8, 8]
    # groups that do not divide over nodes: the global policy, no error
    phy2log, log2phy, logcnt = call(convention, torch.tensor([[10, 20, 30, 40, 50, 60]]), 8, 3, 2, 4)
    check_valid(phy2log, log2phy, logcnt, 6)
    # any device/dtype of weight: float and half
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        phy2log, log2phy, logcnt = call(convention, torch.tensor([[10, 20, 30, 40]], dtype=dtype), 6, 2, 1, 2)
        check_valid(phy2log, log2phy, logcnt, 4)


@pytest.mark.parametrize("args", [(7, 2, 2, 4), (3, 1, 1, 1), (8, 0, 1, 4), (8, 1, 1, 0)])
def test_impossible_arguments_raise_one_line_errors(args: tuple[int, int, int, int]) -> None:
    weight = torch.tensor([[10, 20, 30, 40]])
    with pytest.raises(core.PolicyInputError) as err:
        EplbPolicy.rebalance_experts(weight, *args)
    assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)  # vLLM's tests expect either
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("old", "message"), [
    ([[0, 1, 2, 3, 99, 0]] * 2, r"\[0\]\[4\] is 99: expert ids run 0\.\.3 \(-1 marks an empty slot\)$"),
    ([[0, 1, 2, 3, -2, 0]] * 2, r"\[0\]\[4\] is -2: expert ids run 0\.\.3 \(-1 marks an empty slot\)$"),
    ([[0, 1, 2, 0, 1, 2]] * 2, r": logical expert 3 has no replica in layer 0 \(2 missing in all\)$"),
    ([[0.0, 1, 2, 3, 0, 1]] * 2, r" must hold integer expert ids, got float"),
])
def test_an_old_map_no_engine_can_serve_is_refused_in_one_line(old: list[list[Any]], message: str) -> None:
    """An id 99 or a missing expert raised the solvers' InvalidPlacement, an id -2 was taken (as an unused slot):
    each is the plug-in's PolicyInputError naming the argument (not the solvers' phy2log), whether a tensor, a numpy
    array or lists."""
    weight = torch.tensor([[10, 20, 30, 40]] * 2)
    for given in (torch.tensor(old), np.asarray(old), old):
        with pytest.raises(core.PolicyInputError, match=rf"^old_global_expert_indices{message}"):
            EplbPolicy.rebalance_experts(weight, 6, 1, 1, 2, given)


def test_numpy_arrays_lists_and_int_counts_are_taken_and_anything_else_is_refused() -> None:
    """An old map as a list raised AttributeError 'detach', a float num_replicas TypeError, a 0-layer weight
    'cannot reshape array of size 0' from greedy.py: lists and numpy arrays are taken as tensors are, integer
    counts of any kind as ints, and the rest is a one-line PolicyInputError naming the argument."""
    weight, old = [[10, 20, 30, 40]] * 2, [[0, 1, 2, 3, 0, 1]] * 2
    expected = EplbPolicy.rebalance_experts(torch.tensor(weight), 6, 1, 1, 2, torch.tensor(old)).tolist()
    for w, o in ((weight, old), (np.asarray(weight), np.asarray(old)), (torch.tensor(weight), old)):
        assert EplbPolicy.rebalance_experts(w, 6, 1, 1, 2, o).tolist() == expected
    counts = (np.int64(6), np.int32(1), torch.tensor(1), 2)
    got = EplbPolicy.rebalance_experts(torch.tensor(weight), *counts, torch.tensor(old))  # type: ignore[arg-type]
    assert got.tolist() == expected
    for args, refused in (((6.0, 1, 1, 2), "num_replicas must be a whole number (an int), got 6.0 (float)"),
                          ((6, 1.5, 1, 2), "num_groups must be a whole number (an int), got 1.5 (float)"),
                          ((6, 1, True, 2), "num_nodes must be a whole number (an int), got True (bool)"),
                          ((6, 1, 1, "2"), "num_ranks must be a whole number (an int), got '2' (str)")):
        with pytest.raises(core.PolicyInputError, match=f"^{re.escape(refused)}$"):
            EplbPolicy.rebalance_experts(torch.tensor(weight), *args)
    for bad, refused in ((torch.zeros(0, 4), "weight must be [layers, experts] with at least one of each, got shape "
                                             "(0, 4)"),
                         ([[1, 2], [3]], "weight must be a rectangular array of numbers (a tensor, a numpy array or "
                                         "nested lists), got a list"),
                         ([["a", "b"]], "weight must be a rectangular array of numbers")):
        with pytest.raises(core.PolicyInputError, match=f"^{re.escape(refused)}"):
            EplbPolicy.rebalance_experts(bad, 6, 1, 1, 2)


def test_more_slots_per_rank_than_experts_or_more_ranks_than_eplb_places_are_refused() -> None:
    """num_replicas=10**12 (a mistyped count) raised MemoryError 'Unable to allocate 14.6 TiB' from the drop-in, 10**6
    on 4 ranks ran greedy for minutes: by the rule of every eplb cluster a rank has at most one slot per expert, and
    there are at most CLI_MAX_GPUS ranks, each refused in one line naming the engine's arguments. E slots per rank
    is taken."""
    weight = torch.arange(16, dtype=torch.float64).reshape(2, 8) + 1
    for args, refused in (
            ((10**12, 1, 1, 4), "num_replicas (1,000,000,000,000) over num_ranks (4) is 250,000,000,000 slots per rank "
                                "but only 8 experts (the last dimension of weight): a rank never needs more slots "
                                "than there are experts"),
            ((36, 1, 1, 4), "num_replicas (36) over num_ranks (4) is 9 slots per rank but only 8 experts"),
            ((2**20, 1, 1, 2**17), "num_ranks (131,072) is more EP ranks than eplb places (at most 65,536)")):
        with pytest.raises(core.PolicyInputError, match=f"^{re.escape(refused)}"):
            EplbPolicy.rebalance_experts(weight, *args)
    check_valid(*call("tuple", weight, 32, 1, 1, 4), 8)


def test_complex_loads_or_maps_are_refused_not_cut_to_their_real_part() -> None:
    """A complex weight tensor was placed on its real part, torch saying only 'UserWarning: Casting complex values to
    real discards the imaginary part'; a complex numpy array was 'no rectangular array of numbers'. Both are refused
    naming the dtype, as is a complex map."""
    weight, old = torch.tensor([[10.0, 20.0, 30.0, 40.0]] * 2), torch.tensor([[0, 1, 2, 3, 0, 1]] * 2)
    for bad, dtype in ((weight.to(torch.complex64), "complex64"), (weight.numpy().astype(np.complex128), "complex128")):
        with pytest.raises(core.PolicyInputError, match=f"^weight must hold real numbers, got {dtype}$"):
            EplbPolicy.rebalance_experts(bad, 6, 1, 1, 2)
    with pytest.raises(core.PolicyInputError, match=r"^old_global_expert_indices must hold real numbers, got "
                                                    r"complex64$"):
        EplbPolicy.rebalance_experts(weight, 6, 1, 1, 2, old.to(torch.complex64))


@pytest.mark.parametrize("value", [1e16, 1e300, 1.7e308, float("inf"), float("nan"), -1.0])
def test_loads_no_window_could_hold_are_refused_by_the_windows_rule(value: float) -> None:
    """Any finite load passed: above 1e15 it reached the C kernel, at 1.7e308 greedy corrupted memory. The plug-in
    refuses it up front by the rule of the CLI's and the service's windows (eplb.io.windows.check_loads), in remote
    mode before anything is sent; 1e15, the limit, is taken."""
    weight = np.array([[10.0, 20.0, value, 40.0]])
    with pytest.raises(EplbError) as by_windows:
        check_loads(weight, "weight")
    for settings in (core.Settings(), core.Settings(service_url="http://127.0.0.1:9", deployment="d")):
        with pytest.raises(core.PolicyInputError) as refused:
            core.rebalance(weight, 6, 1, 1, 2, settings=settings)
        assert str(refused.value) == str(by_windows.value) and str(refused.value).startswith("weight[0][2] is ")
    weight[0, 2] = 1e15
    check_valid(*call("tuple", torch.from_numpy(weight), 6, 1, 1, 2), 4)


@pytest.mark.parametrize("solver", ["deepseek", "greedy"])
def test_a_hierarchical_topology_no_group_packing_fits_is_refused_naming_the_engines_arguments(
        solver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """num_groups a multiple of num_nodes selects DeepSeek's hierarchical policy, which the drop-in runs for every
    window of no tokens (vLLM's start-up profile run) and every fallback. Groups that do not divide the experts, or
    ranks that do not split over the nodes, raised the drop-in's bare AssertionError ('experts (8) must be a multiple
    of 3', 'GPUs (3) must be a multiple of 2') naming none of the engine's arguments: now the plug-in's one line,
    with any solver, locally and for a window without tokens; one where the groups do not split over the nodes is the
    global policy, placed."""
    monkeypatch.setenv("EPLB_SOLVER", solver)
    weight = torch.arange(16, dtype=torch.float64).reshape(2, 8) + 1
    for w in (weight, torch.zeros_like(weight)):
        for args, refused in (
                ((12, 3, 1, 4), "num_groups (3) must divide the number of experts (8, the last dimension of weight): "
                                "when num_groups (3) is a multiple of num_nodes (1), DeepSeek's hierarchical"),
                ((12, 2, 2, 3), "num_ranks (3) must be a multiple of num_nodes (2): when num_groups (2) is a multiple "
                                "of num_nodes (2)")):
            with pytest.raises(core.PolicyInputError, match=f"^{re.escape(refused)}"):
                EplbPolicy.rebalance_experts(w, *args)
        check_valid(*call("tuple", w, 12, 3, 2, 4), 8)


def test_the_log_lines_docs_tell_to_verify_by_are_the_ones_a_rebalance_logs(caplog: pytest.LogCaptureFixture) -> None:
    """docs/integrations.md said every rebalance logs 'eplb policy (local): deepseek, <N> copies (no limit)'; from
    vLLM's serving map it logs 'incremental, <N> copies (no limit)' (the fresh placement only when it balances more
    than 1% better), and without a map 'deepseek' alone. The doc quotes the lines the plug-in logs."""
    doc = " ".join((ROOT / "docs" / "integrations.md").read_text().split())
    first = EplbPolicy.rebalance_experts(torch.from_numpy(PREFILL), 288, 1, 1, 32)
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        EplbPolicy.rebalance_experts(torch.from_numpy(PREFILL), 288, 1, 1, 32)
        EplbPolicy.rebalance_experts(torch.from_numpy(DECODE), 288, 1, 1, 32, first)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.eplb_plugin"]
    assert lines[0] == "eplb policy (local): deepseek"
    assert re.fullmatch(r"eplb policy \(local\): incremental, \d+ copies \(no limit\)", lines[1]), lines[1]
    assert ("every rebalance logs `eplb policy (local): incremental, <N> copies (no limit)` from the serving map "
            "(`deepseek (incremental lb ... vs fresh ...), <N> copies (no limit)` when a fresh placement balanced "
            "better, `deepseek` alone when vLLM passed no map") in doc


def test_hierarchical_policy_keeps_each_group_on_one_node() -> None:
    rng = np.random.default_rng(3)
    weight = torch.from_numpy(rng.pareto(1.2, size=(4, 64)) * 100)
    phy2log = EplbPolicy.rebalance_experts(weight, 96, 8, 4, 16).numpy()
    node_of_slot = np.repeat(np.arange(4), 96 // 4)
    for layer in range(4):
        for group in range(8):
            members = np.isin(phy2log[layer], np.arange(group * 8, (group + 1) * 8))
            assert np.unique(node_of_slot[members]).size == 1


# --- with the serving map ---------------------------------------------------------------------------


def stays_in_old_slot(old: np.ndarray, new: np.ndarray, num_ranks: int) -> bool:
    """vLLM's check: an expert on a GPU before and after sits, after, in (the first of) its old slots."""
    spg = old.shape[1] // num_ranks
    for layer in range(old.shape[0]):
        for g in range(num_ranks):
            o, n = old[layer, g * spg : (g + 1) * spg].tolist(), new[layer, g * spg : (g + 1) * spg].tolist()
            for expert in set(o) & set(n):
                if expert >= 0 and n[o.index(expert)] != expert:
                    return False
    return True


@pytest.mark.parametrize("budget", [0, 500, 2000, None])
def test_real_drift_moves_within_budget_and_keeps_slots(budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's published DeepSeek-V3 windows, prefill then decode, EP32 with 288 slots."""
    old = EplbPolicy.rebalance_experts(torch.from_numpy(PREFILL), 288, 8, 4, 32)
    if budget is not None:
        monkeypatch.setenv("EPLB_MAX_MOVES", str(budget))
    new = EplbPolicy.rebalance_experts(torch.from_numpy(DECODE), 288, 8, 4, 32, old).numpy()
    copies = int(core.moves(new, old.numpy(), 32).sum())
    fresh = EplbPolicy.rebalance_experts(torch.from_numpy(DECODE), 288, 8, 4, 32).numpy()
    assert copies <= int(core.moves(fresh, old.numpy(), 32).sum())
    if budget is not None:
        assert copies <= budget
    if budget == 0:
        assert np.array_equal(new, old.numpy())
    assert stays_in_old_slot(old.numpy(), new, 32)
    replicas = np.apply_along_axis(np.bincount, 1, new, minlength=256)
    assert (replicas >= 1).all()
    lb_new, lb_old = core.layer_lb(DECODE, new, 32), core.layer_lb(DECODE, old.numpy(), 32)
    assert lb_new.mean() <= lb_old.mean()
    if core.INCREMENTAL not in registry.names():  # the fallback: DeepSeek's map, relabelled, layers within budget
        if budget is None:
            assert np.array_equal(replicas, np.apply_along_axis(np.bincount, 1, fresh, minlength=256))
        assert (lb_new <= lb_old + 1e-12).all()  # copies are spent only where they lower lb


@pytest.mark.parametrize(
    ("num_ranks", "old", "new"),
    [  # vLLM's own preserve_intragpu_slots scenarios: shuffles, duplicates, one skewed expert
        (2, [0, 1, 2, 3, 4, 5, 6, 7], [1, 5, 0, 4, 6, 2, 7, 3]),
        (2, [0, 1, 0, 2, 3, 4, 5, 6, 1, 2], [0, 5, 4, 0, 1, 6, 2, 3, 2, 1]),
        (3, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0]),
    ],
)
def test_slot_keeping_on_vllms_scenarios(num_ranks: int, old: list[int], new: list[int]) -> None:
    o, n = np.array([old]), np.array([new])
    kept = core.keep_slots(n, o, num_ranks, 1)
    assert stays_in_old_slot(o, kept, num_ranks)
    assert sorted(kept[0].tolist()) == sorted(new)  # the same replicas
    assert core.moves(kept, o, num_ranks).sum() <= core.moves(n, o, num_ranks).sum()
    spg = len(old) // num_ranks  # every GPU of the result holds what one GPU of the new map held
    gpus_new = sorted(sorted(new[g * spg : (g + 1) * spg]) for g in range(num_ranks))
    assert sorted(sorted(kept[0, g * spg : (g + 1) * spg].tolist()) for g in range(num_ranks)) == gpus_new


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("budget", [None, 0, 40])
def test_unused_slots_marked_minus_one(convention: str, budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM marks slots it does not use with -1 in the serving map; they hold nothing and cost no copy."""
    rng = np.random.default_rng(0)
    weight = rng.pareto(1.0, size=(6, 32)) * 100
    old = EplbPolicy.rebalance_experts(torch.from_numpy(weight), 48, 1, 1, 8).numpy()
    old_unused = old.copy()
    for layer in range(6):  # drop every second replica of each replicated expert: those slots become -1
        seen: set[int] = set()
        for s, e in enumerate(old[layer]):
            if e in seen:
                old_unused[layer, s] = -1
            seen.add(e)
    assert (old_unused < 0).any()
    if budget is not None:
        monkeypatch.setenv("EPLB_MAX_MOVES", str(budget))
    new_weight = torch.from_numpy(weight[:, ::-1].copy())
    phy2log, log2phy, logcnt = call(convention, new_weight, 48, 1, 1, 8, torch.from_numpy(old_unused))
    p = phy2log.numpy()
    assert p.shape == (6, 48)
    if budget == 0:
        assert np.array_equal(p, old_unused)
    else:
        copies = int(core.moves(p, old_unused, 8).sum())
        assert budget is None or copies <= budget
        assert stays_in_old_slot(old_unused, p, 8)
    for layer in range(6):  # every expert still served; log2phy and logcnt ignore unused slots
        assert set(p[layer][p[layer] >= 0].tolist()) == set(range(32))
        assert int(logcnt[layer].sum()) == int((p[layer] >= 0).sum())
        assert ((log2phy[layer] >= 0).sum(dim=1) == logcnt[layer]).all()


def test_old_map_of_another_shape_is_ignored() -> None:
    weight = torch.tensor([[5, 1, 1, 1]] * 2)
    old = torch.tensor([[0, 1, 2, 3]] * 2)
    out = EplbPolicy.rebalance_experts(weight, 8, 1, 1, 2, old)
    assert out.tolist() == EplbPolicy.rebalance_experts(weight, 8, 1, 1, 2).tolist()


def test_greedy_solver_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPLB_SOLVER", "greedy")
    phy2log = EplbPolicy.rebalance_experts(torch.from_numpy(DECODE), 288, 8, 4, 32).numpy()
    monkeypatch.setenv("EPLB_SOLVER", "deepseek")
    deepseek = EplbPolicy.rebalance_experts(torch.from_numpy(DECODE), 288, 8, 4, 32).numpy()
    assert core.layer_lb(DECODE, phy2log, 32).mean() < core.layer_lb(DECODE, deepseek, 32).mean()
    monkeypatch.setenv("EPLB_SOLVER", "nope")
    with pytest.raises(core.PolicyInputError, match="EPLB_SOLVER"):
        EplbPolicy.rebalance_experts(torch.from_numpy(DECODE), 288, 8, 4, 32)


def test_the_solvers_the_plug_in_accepts_are_those_it_can_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EPLB_SOLVER=incremental and greedy-coact raised SolverError at every rebalance though a typo's message listed
    them, and milp-weighted's shares were dropped (the engines route evenly). Every accepted name places and
    rebalances; the two the engines cannot serve are refused naming why; a typo lists exactly the accepted ones."""
    accepted = core.plugin_solvers()
    assert sorted(accepted + list(core.UNSERVABLE)) == sorted(registry.names())
    for name in registry.names():  # what the engines cannot give a solver (co-activation) or serve (shares)
        caps = registry.get_solver(name).capabilities
        assert (name in core.UNSERVABLE) == (caps.shares or caps.coactivation), name
        assert name in core.UNSERVABLE or not caps.requires_current or name == core.INCREMENTAL, name
    rng = np.random.default_rng(5)
    weight = torch.from_numpy(rng.integers(0, 1000, (2, 16)).astype(np.float64))
    later = torch.from_numpy(rng.integers(0, 1000, (2, 16)).astype(np.float64))
    for name in accepted:
        monkeypatch.setenv("EPLB_SOLVER", name)
        with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
            caplog.clear()
            first = call("phy2log", weight, 24, 1, 1, 4)
            check_valid(*first, 16)
            again = call("phy2log", later, 24, 1, 1, 4, first[0])
            check_valid(*again, 16)
        placed, rebalanced = (r.getMessage() for r in caplog.records)
        if name == core.INCREMENTAL:  # places as the default does, then edits the engine's map
            assert placed.endswith("deepseek (incremental edits the engine's map, and it passed none)")
            assert "(local): incremental, " in rebalanced
    for name, why in (("milp-weighted", "replicas weighted shares, and vLLM and SGLang send an expert's tokens evenly"),
                      ("greedy-coact", "co-activation counts (which experts tokens choose together), which the "
                                       "engines do not pass")):
        monkeypatch.setenv("EPLB_SOLVER", name)
        refusal = rf"^EPLB_SOLVER='{name}' cannot serve an engine: it (needs|gives) {re.escape(why)}.*; choose one of "
        with pytest.raises(core.PolicyInputError, match=rf"{refusal}{', '.join(accepted)}$"):
            EplbPolicy.rebalance_experts(weight, 24, 1, 1, 4)
    monkeypatch.setenv("EPLB_SOLVER", "greedy-coatc")
    typo = rf"^EPLB_SOLVER='greedy-coatc': choose one of {', '.join(accepted)}$"
    with pytest.raises(core.PolicyInputError, match=typo):
        EplbPolicy.rebalance_experts(weight, 24, 1, 1, 4)


def test_incremental_keeps_its_edit_where_the_default_places_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """EPLB_SOLVER=incremental: without a budget the edit of the engine's map stands, where the default replaces it by
    a fresh placement (its lb more than INCREMENTAL_LB_TOLERANCE above: here always, the tolerance set to 0); a map
    with -1 slots is placed by the default, and the log line says so."""
    old, _ = core.fresh(PREFILL, 288, 8, 4, 32, "deepseek")
    monkeypatch.setattr(core, "INCREMENTAL_LB_TOLERANCE", 0.0)
    default = core.solve_local(DECODE, 288, 8, 4, 32, old, core.Settings())
    edited = core.solve_local(DECODE, 288, 8, 4, 32, old, core.Settings(solver="incremental"))
    assert default.how.startswith("deepseek (incremental lb ") and edited.how.startswith("incremental, ")
    holed = old.copy()
    for layer in range(holed.shape[0]):  # one slot left unused, of an expert with another replica
        counts = np.bincount(holed[layer], minlength=256)
        holed[layer, int(np.flatnonzero(counts[holed[layer]] > 1)[0])] = -1
    unused = core.solve_local(DECODE, 288, 8, 4, 32, holed, core.Settings(solver="incremental"))
    assert unused.how.startswith("deepseek (incremental edits a map with every slot filled; this one has -1 slots), ")


# --- convention detection and registration -------------------------------------------------------------


class _OldAbstract:  # vLLM's first policy interface: no serving map, three tensors back
    @classmethod
    def rebalance_experts(
        cls, weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class _MiddleAbstract:  # the serving map added, still three tensors back
    @classmethod
    def rebalance_experts(
        cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
        old_global_expert_indices: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class _NewAbstract:  # phy2log alone back
    @classmethod
    def rebalance_experts(
        cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
        old_global_expert_indices: Any = None,
    ) -> torch.Tensor:
        raise NotImplementedError


class _Unannotated:
    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError


@pytest.mark.parametrize(
    ("abstract", "expected"),
    [(_OldAbstract, "tuple"), (_MiddleAbstract, "tuple"), (_NewAbstract, "phy2log"), (_Unannotated, "phy2log")],
)
def test_convention_detection(abstract: type, expected: str) -> None:
    assert plugin.detect_convention(abstract) == expected
    assert policy_class(plugin.detect_convention(abstract)).convention == expected


POLICY_PACKAGE = '''
from abc import ABC, abstractmethod
import torch

class AbstractEplbPolicy(ABC):
    @classmethod
    @abstractmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                          old_global_expert_indices=None) -> {returns}:
        raise NotImplementedError

class DefaultEplbPolicy(AbstractEplbPolicy):
    @classmethod
    def rebalance_experts(cls, *args, **kwargs):
        raise RuntimeError("vLLM's default")

EPLB_POLICIES = {{"default": DefaultEplbPolicy}}
'''


PLAN_POLICY_PACKAGE = '''
from abc import ABC, abstractmethod
from dataclasses import dataclass
import torch

@dataclass(frozen=True)
class EplbTopology:
    num_groups: int
    num_nodes: int
    num_ranks: int

@dataclass(frozen=True)
class EplbRebalanceContext:
    load_window_cpu: torch.Tensor  # [samples, layers, experts], oldest first
    physical_to_logical_map_cpu: torch.Tensor  # [layers, physical experts]
    topology: EplbTopology
    num_replicas: int
    cpu_group: object

@dataclass(frozen=True)
class EplbPlan:
    physical_to_logical_map: torch.Tensor

class EplbPolicyState:
    pass

class AbstractEplbPolicy(ABC):
    def create_state(self, num_moe_layers):
        return EplbPolicyState()

    @abstractmethod
    def plan_rebalance(self, context, policy_state):
        raise NotImplementedError

    def on_layer_committed(self, policy_state, plan, layer_idx):
        return None

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                          old_global_expert_indices=None) -> torch.Tensor:
        raise NotImplementedError

class DefaultEplbPolicy(AbstractEplbPolicy):
    def plan_rebalance(self, context, policy_state):
        raise RuntimeError("vLLM's default")

EPLB_POLICIES = {"default": DefaultEplbPolicy}
'''
"""vLLM's policy package as its sources read by the search tool have it after 0.33.0 (the newest release, which has
the `rebalance_experts` class method alone): a policy is an instance, EplbState asks it `plan_rebalance(context,
policy_state)` (one version: `plan_rebalance(context)`), abstract, for an `EplbPlan`; `rebalance_experts` stays as
the legacy class method. vLLM itself cannot be installed here (it pins its own CUDA torch and 79 packages)."""


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Lay out a package tree with vLLM's module paths (`vllm.distributed.eplb.policy` or the older
    `eplb_state` + `rebalance_algo`) on sys.path; removed again afterwards."""

    def make(layout: str) -> None:
        eplb_dir = tmp_path / "vllm" / "distributed" / "eplb"
        eplb_dir.mkdir(parents=True)
        for d in (tmp_path / "vllm", tmp_path / "vllm" / "distributed", eplb_dir):
            (d / "__init__.py").write_text("")
        if layout == "table-old":
            (eplb_dir / "policy").mkdir()
            returns = "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"
            (eplb_dir / "policy" / "__init__.py").write_text(POLICY_PACKAGE.format(returns=returns))
        elif layout == "table-new":
            (eplb_dir / "policy").mkdir()
            (eplb_dir / "policy" / "__init__.py").write_text(POLICY_PACKAGE.format(returns="torch.Tensor"))
        elif layout == "table-plan":
            (eplb_dir / "policy").mkdir()
            (eplb_dir / "policy" / "__init__.py").write_text(PLAN_POLICY_PACKAGE)
        else:
            (eplb_dir / "rebalance_algo.py").write_text("def rebalance_experts(*args):\n    raise RuntimeError\n")
            (eplb_dir / "eplb_state.py").write_text("from .rebalance_algo import rebalance_experts\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    yield make
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def test_register_without_vllm_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    assert importlib.util.find_spec("vllm") is None
    with caplog.at_level(logging.INFO):
        plugin.register()
    assert "vLLM is not installed" in caplog.text


@pytest.mark.parametrize(("layout", "convention"), [("table-new", "phy2log"), ("table-old", "tuple")])
@pytest.mark.parametrize("select", [False, True])
def test_register_adds_the_policy_to_vllms_table(
    fake_vllm: Callable[[str], None], layout: str, convention: str, select: bool,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    fake_vllm(layout)
    if select:
        monkeypatch.setenv("EPLB_VLLM_POLICY", "eplb")
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        plugin.register()
        plugin.register()  # vLLM loads plug-ins in every process, maybe twice: idempotent
    policy = importlib.import_module("vllm.distributed.eplb.policy")
    cls = policy.EPLB_POLICIES["eplb"]
    assert issubclass(cls, policy.AbstractEplbPolicy) and issubclass(cls, EplbPolicy)
    assert cls.convention == convention
    assert (policy.EPLB_POLICIES["default"] is cls) == select
    assert f"({convention} convention)" in caplog.text
    out = cls.rebalance_experts(torch.tensor([[10, 20, 30, 40]]), 6, 2, 1, 2)  # vLLM's call: a class method
    assert (out[0] if convention == "tuple" else out).shape == (1, 6)


def test_on_vllm_with_plan_rebalance_the_policy_is_an_instance_that_plans(
    fake_vllm: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM after 0.33.0 makes `plan_rebalance(context, policy_state)` the policy's abstract entry point and
    instantiates the policy: the class register() made could not be instantiated there (TypeError: abstract method
    plan_rebalance). It plans now, from the context's window summed over its samples and its serving map, the
    placement `rebalance_experts` (still there, a class method, for vLLM 0.33.0 and older) answers; its errors
    name the context's fields."""
    fake_vllm("table-plan")
    monkeypatch.setenv("EPLB_VLLM_POLICY", "eplb")
    plugin.register()
    package = importlib.import_module("vllm.distributed.eplb.policy")
    cls = package.EPLB_POLICIES["eplb"]
    assert package.EPLB_POLICIES["default"] is cls and cls.convention == "phy2log"
    policy = cls()
    window = torch.tensor([[[10, 20, 30, 40]], [[30, 0, 50, 0]]])
    serving = torch.tensor([[0, 1, 2, 3, 0, 1]])
    context = package.EplbRebalanceContext(window, serving, package.EplbTopology(2, 1, 2), 6, None)
    legacy = cls.rebalance_experts(window.sum(dim=0), 6, 2, 1, 2, serving)
    for plan in (policy.plan_rebalance(context, policy.create_state(1)), policy.plan_rebalance(context)):
        assert isinstance(plan, package.EplbPlan)
        target = plan.physical_to_logical_map
        assert target.dtype == torch.int64 and target.device.type == "cpu" and target.shape == (1, 6)
        assert torch.equal(target, legacy)
    assert set(legacy[0].tolist()) == {0, 1, 2, 3}
    odd = replace(context, num_replicas=5)
    with pytest.raises(core.PolicyInputError, match=r"^context\.num_replicas \(5\) must be a multiple of "
                       r"context\.topology\.num_ranks \(2\)$"):
        policy.plan_rebalance(odd, policy.create_state(1))


def test_register_on_vllm_before_the_policy_table(
    fake_vllm: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_vllm("function")
    plugin.register()
    state = importlib.import_module("vllm.distributed.eplb.eplb_state")
    assert state.rebalance_experts.__qualname__ != "EplbPolicy.rebalance_experts"  # not selected: untouched
    monkeypatch.setenv("EPLB_VLLM_POLICY", "eplb")
    plugin.register()
    phy2log, log2phy, logcnt = state.rebalance_experts(torch.tensor([[10, 20, 30, 40]]), 6, 2, 1, 2)
    check_valid(phy2log, log2phy, logcnt, 4)


@pytest.mark.parametrize(("env", "message"), [
    ({"EPLB_MAX_MOVES": "99999999999999999999999"}, r"^EPLB_MAX_MOVES must be [^\n]*10,000,000"),
    ({"EPLB_SERVICE_TIMEOUT_S": "inf"}, r"^EPLB_SERVICE_TIMEOUT_S must be a number of seconds above 0 and at most "
                                        r"86,400 \(a day\), got inf$"),
    ({"EPLB_SOLVER": "milp-weighted"}, r"^EPLB_SOLVER='milp-weighted' cannot serve an engine: "),
])
def test_a_setting_no_rebalance_can_use_stops_the_engines_start(
    fake_vllm: Callable[[str], None], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """register() checked EPLB_VLLM_POLICY alone: EPLB_MAX_MOVES=99999999999999999999999 was an OverflowError in
    incremental.py at the first rebalance (hours in), EPLB_SERVICE_TIMEOUT_S=inf was taken. Now vLLM's start stops
    with the one-line error every rebalance would raise (one function, core.environment), nothing registered."""
    fake_vllm("table-new")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(core.PolicyInputError, match=message) as at_start:
        plugin.register()
    assert "eplb" not in importlib.import_module("vllm.distributed.eplb.policy").EPLB_POLICIES
    with pytest.raises(core.PolicyInputError) as at_rebalance:
        EplbPolicy.rebalance_experts(torch.tensor([[10, 20, 30, 40]]), 6, 1, 1, 2, torch.tensor([[0, 1, 2, 3, 0, 1]]))
    assert str(at_start.value) == str(at_rebalance.value) and "\n" not in str(at_start.value)


def test_settings_that_do_nothing_are_warned_once_at_start(
    fake_vllm: Callable[[str], None], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unknown EPLB_* name (EPLB_MAX_MOVE), a selection other than eplb (SGLang's was ignored without a word) and
    EPLB_DEPLOYMENT without EPLB_SERVICE_URL (solved locally without a word; the reverse said so) are WARNINGs at
    start, once however often vLLM calls register(); the rebalance says the last one, as it says the reverse."""
    fake_vllm("table-new")
    for name, value in (("EPLB_MAX_MOVE", "10"), ("EPLB_VLLM_POLICY", "default"), ("EPLB_SGLANG_ALGORITHM", "eplb2"),
                        ("EPLB_DEPLOYMENT", "prod")):
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        plugin.register()
        plugin.register()
    read = ", ".join(core.ENV_NAMES)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"eplb plugin: EPLB_MAX_MOVE is no setting of the engine plug-ins, ignored (they read {read})",
        "eplb plugin: EPLB_VLLM_POLICY='default' is not 'eplb': vLLM's own policy stays under 'default'",
        "eplb plugin: EPLB_SGLANG_ALGORITHM='eplb2' is not 'eplb': --eplb-algorithm alone selects the algorithm",
        "eplb plugin: EPLB_DEPLOYMENT is set without EPLB_SERVICE_URL: every rebalance solves locally",
    ]
    assert read == ("EPLB_SOLVER, EPLB_MAX_MOVES, EPLB_SERVICE_URL, EPLB_DEPLOYMENT, EPLB_API_KEY, "
                    "EPLB_SERVICE_TIMEOUT_S, EPLB_VLLM_POLICY, EPLB_SGLANG_ALGORITHM")
    result = core.rebalance(np.ones((2, 4)), 8, 1, 1, 2)
    assert result.how.endswith("; EPLB_DEPLOYMENT is set without EPLB_SERVICE_URL, so solved locally")
    _, notes = core.environment({"EPLB_SERVICE_URL": "http://h:1", "EPLB_MAX_MOVE": "1", "EPLB_API_KE": "k"})
    assert notes == [f"EPLB_API_KE, EPLB_MAX_MOVE are no settings of the engine plug-ins, ignored (they read {read})",
                     "EPLB_SERVICE_URL is set without EPLB_DEPLOYMENT: every rebalance solves locally"]
    _, notes = core.environment({"EPLB_SERVICE_URL": "ftp://h", "EPLB_DEPLOYMENT": "a b"})
    assert notes == ["EPLB_SERVICE_URL='ftp://h' is no http(s) URL: every rebalance will solve locally",
                     "EPLB_DEPLOYMENT='a b' is no deployment name the service can have (use 1-100 letters, digits, "
                     "'.', '_' or '-', starting with a letter or digit): every rebalance will solve locally"]
    assert core.environment({"EPLB_SERVICE_URL": "http://h:1", "EPLB_DEPLOYMENT": "d", "EPLB_VLLM_POLICY": "eplb",
                             "EPLB_SGLANG_ALGORITHM": "eplb", "EPLB_MAX_MOVES": "5"})[1] == []


def test_entry_point_is_installed() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "eplb"]
    assert ep.value == "eplb.integrations.vllm:register" and ep.load() is plugin.register


def test_torch_is_imported_only_by_the_plug_ins() -> None:
    statement = re.compile(r"^(\s*)(import torch\b|from torch\b)", re.MULTILINE)
    for path in [*ROOT.glob("eplb/**/*.py"), *ROOT.glob("solvers/**/*.py"), *ROOT.glob("api/**/*.py")]:
        for match in statement.finditer(path.read_text()):
            assert "integrations" in path.parts, f"{path} imports torch"
            assert match.group(1), f"{path} imports torch at module level"
    code = (
        "import sys, eplb.cli, api.app, eplb.integrations.vllm, eplb.integrations.sglang; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# --- remote mode ------------------------------------------------------------------------------------


def test_remote_falls_back_when_the_service_has_no_such_deployment(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    base = server_factory()
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", "no-such-deployment")
    weight = torch.from_numpy(DECODE[:4])
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        out = EplbPolicy.rebalance_experts(weight, 288, 8, 4, 32)
    assert "answered 404" in caplog.text and "solved locally" in caplog.text
    assert (f"{base}/deployments/no-such-deployment/windows answered 404: no deployment named 'no-such-deployment': "
            "register it with PUT /deployments/no-such-deployment") in caplog.text  # the service's words
    monkeypatch.delenv("EPLB_SERVICE_URL")
    assert out.tolist() == EplbPolicy.rebalance_experts(weight, 288, 8, 4, 32).tolist()


def test_a_401_names_the_setting_that_sends_the_key(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A service with an API key answered the plug-in 401, logged as 'send 'Authorization: Bearer <key>' ...', which
    names no setting of the engine's: the line says EPLB_API_KEY is unset, or not the service's key."""
    base = server_factory(api_key="the-key")
    created = httpx.put(f"{base}/deployments/keyed", json={"model": "mixtral-8x7b", "cluster": {
        "num_gpus": 4, "slots_per_gpu": 4}}, headers={"Authorization": "Bearer the-key"}, timeout=60)
    assert created.status_code in (200, 201), created.text
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", "keyed")
    for key, said in ((None, "EPLB_API_KEY is not set"), ("wrong", "EPLB_API_KEY is not the service's key")):
        if key is not None:
            monkeypatch.setenv("EPLB_API_KEY", key)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
            EplbPolicy.rebalance_experts(torch.ones(2, 8), 16, 1, 1, 4)
        assert (f"remote failed, solved locally: {base}/deployments/keyed/windows answered 401: send 'Authorization: "
                f"Bearer <key>' with the service's API key ({said})") in caplog.text
    monkeypatch.setenv("EPLB_API_KEY", "the-key")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        EplbPolicy.rebalance_experts(torch.ones(2, 8), 16, 1, 1, 4)
    assert "eplb policy (remote): " in caplog.text and "answered 401" not in caplog.text


def test_a_service_url_with_a_path_the_service_has_not_says_so(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EPLB_SERVICE_URL=http://HOST:PORT/api (a path `eplb serve` has no route under) was logged 'answered 404 (no
    deployment 'prod', or a service without deployments)' for a deployment that exists: the 404 of no route is said as
    one, naming the setting to check."""
    base = server_factory()
    remote_mixtral_deployment(base, "routed", monkeypatch)
    monkeypatch.setenv("EPLB_SERVICE_URL", base + "/api")
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        EplbPolicy.rebalance_experts(torch.ones(2, 8), 16, 1, 1, 4)
    assert (f"remote failed, solved locally: {base}/api/deployments/routed/windows answered 404 (Not Found): no such "
            f"route there; is EPLB_SERVICE_URL ({base}/api) the base URL `eplb serve` listens on (http://HOST:PORT, "
            "with no path unless a proxy serves it under one), and does that service keep deployments?") in caplog.text
    assert "no deployment 'routed'" not in caplog.text


def test_remote_mode_uses_the_services_deployment(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """End to end against a real `eplb serve`: the window goes to the deployment, its placement comes back."""
    base = server_factory()
    config = {"model": "deepseek-v3", "cluster": {"num_gpus": 32, "slots_per_gpu": 9},
              "solver": "greedy", "policy": {"trigger": "periodic"}}
    created = httpx.put(f"{base}/deployments/plugin-e2e", json=config, timeout=60)
    assert created.status_code in (200, 201), created.text
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", "plugin-e2e")
    weight = torch.from_numpy(DECODE[:4])
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        out = EplbPolicy.rebalance_experts(weight, 288, 8, 4, 32)
    assert "solved locally" not in caplog.text
    history = httpx.get(f"{base}/deployments/plugin-e2e/history", timeout=60).json()
    assert [e["action"] for e in history["entries"]] == ["placed"]
    current = httpx.get(f"{base}/deployments/plugin-e2e", timeout=60).json()
    phy2log = out[0] if isinstance(out, tuple) else out
    assert phy2log.tolist() == current["placement"]["phy2log"]  # the engine got the service's placement
    # the engine packs 8 groups onto 4 nodes; the deployment's global placement does not, and says what to set
    assert ("answered a placement that spreads expert groups over nodes on 4 of 4 layers, where the engine keeps "
            "each of its 8 groups on one of its 4 nodes") in caplog.text
    assert "set the deployment's cluster.gpus_per_node to 8 and cluster.num_groups to 8" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_deployment_that_keeps_the_engines_groups_on_nodes_is_not_warned_about(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    base = server_factory()
    cluster = {"num_gpus": 32, "slots_per_gpu": 9, "gpus_per_node": 8, "num_groups": 8}
    config = {"model": "deepseek-v3", "cluster": cluster, "solver": "greedy", "policy": {"trigger": "periodic"}}
    created = httpx.put(f"{base}/deployments/plugin-groups", json=config, timeout=60)
    assert created.status_code in (200, 201), created.text
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", "plugin-groups")
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        out = EplbPolicy.rebalance_experts(torch.from_numpy(DECODE[:4]), 288, 8, 4, 32)
    assert "placement from" in caplog.text and "spreads expert groups" not in caplog.text
    phy2log = (out[0] if isinstance(out, tuple) else out).numpy()
    assert core.groups_across_nodes(phy2log, 8, 4) == 0


def test_groups_across_nodes_counts_the_layers_where_a_group_reaches_two_nodes() -> None:
    kept = np.array([[0, 1, 0, 2, 3, 2], [2, 3, -1, 0, 1, 0]])  # 2 groups of 2 experts, 2 nodes of 3 slots
    assert core.groups_across_nodes(kept, 2, 2) == 0
    spread = np.array([[0, 1, 0, 2, 3, 2], [0, 2, 3, 1, 2, 3]])  # layer 1: expert 0 on node 0, expert 1 on node 1
    assert core.groups_across_nodes(spread, 2, 2) == 1


def test_a_window_without_tokens_is_answered_here_and_sent_to_no_service(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's start-up profile run (`EplbState.step(is_profile=True)` calls `rearrange`, which calls the policy with the
    all-zero window and its map, then discards the answer) posted a window of nothing on every rank: the deployment
    recorded vLLM's map as applied and a kept window without tokens, and an engine without a map remembered the
    deployment's placement as served. Now nothing is sent: the engine's map stays (an engine without one: the map the
    plug-in answered last, else DeepSeek's placement); in local mode too, where the incremental solver spent copies on
    a window of nothing (repairing a map's same-GPU duplicates)."""
    from solvers.greedy import rebalance_experts as deepseek

    base = server_factory()
    remote_mixtral_deployment(base, "plugin-profile", monkeypatch)
    zeros = torch.zeros(4, 8, dtype=torch.int32)  # vLLM's expert_load_window dtype, folded and summed
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        kept = EplbPolicy.rebalance_experts(zeros, 16, 1, 1, 4, torch.from_numpy(INITIAL))
    assert kept.tolist() == INITIAL.tolist()
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "vllm.eplb_plugin"] == [
        (logging.INFO, f"eplb policy (local): the window has no tokens: the serving map stays, 0 copies; not sent to "
                       f"{base}")]
    first = EplbPolicy.rebalance_experts(zeros, 16, 1, 1, 4)  # vLLM before old_global_expert_indices
    assert first.tolist() == deepseek(np.zeros((4, 8)), 16, 1, 1, 4)[0].tolist()
    assert _current(base, "plugin-profile")["windows"] == 0 and _history(base, "plugin-profile") == []
    served = EplbPolicy.rebalance_experts(torch.from_numpy(np.random.default_rng(16).pareto(1.0, (4, 8)) * 100),
                                          16, 1, 1, 4)
    assert EplbPolicy.rebalance_experts(zeros, 16, 1, 1, 4).tolist() == served.tolist()  # the map answered last
    assert [e["action"] for e in _history(base, "plugin-profile")] == ["placed"]
    paired = np.tile(np.arange(8).repeat(2), (4, 1))  # each GPU holds two copies of its experts, as DeepSeek's maps can
    local = core.rebalance(np.zeros((4, 8)), 16, 1, 1, 4, paired.copy(), settings=core.Settings())
    assert np.array_equal(local.phy2log, paired)  # not 32 copies spent on repairing them for a window of nothing
    assert local.how == "the window has no tokens: the serving map stays, 0 copies"


@pytest.mark.parametrize("url", ["http://[::1", "ftp://127.0.0.1", "no url"])
def test_a_service_url_that_is_no_http_url_falls_back(url: str) -> None:
    """httpx raises InvalidURL, no HTTPError, for 'http://[::1': a WARNING and a local solve, not a traceback."""
    result = core.rebalance(np.ones((2, 4)), 8, 1, 1, 2, settings=core.Settings(service_url=url, deployment="d"))
    assert result.source == "local" and result.fell_back and "unreachable" in result.how


def test_remote_falls_back_when_the_service_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("EPLB_SERVICE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("EPLB_DEPLOYMENT", "prod")
    weight = np.asarray(DECODE[:3], dtype=np.float64)
    result = core.rebalance(weight, 288, 8, 4, 32)
    assert result.source == "local" and result.fell_back and "unreachable" in result.how
    assert np.array_equal(result.phy2log, core.rebalance(weight, 288, 8, 4, 32, settings=core.Settings()).phy2log)


def _answering(status: int, body: Any) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/deployments/prod/windows"
        assert request.headers["authorization"] == "Bearer k"
        assert np.asarray(json.loads(request.content)["loads"]).shape == (2, 4)
        return httpx.Response(status, json=body)

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://svc")


def _placed(phy2log: list[list[Any]], slots_per_gpu: Any = (3, 3), **more: Any) -> dict[str, Any]:
    placement = {"phy2log": phy2log, "slots_per_gpu": list(slots_per_gpu), **more}
    return {"action": "placed", "result": {"placement": placement}}


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, _placed([[0, 1, 2, 3, 0, 0]] * 2), np.array([[0, 1, 2, 3, 0, 0]] * 2)),
        (200, _placed([[0, 1, 2, 3, 0, 0]] * 2, num_gpus=2), np.array([[0, 1, 2, 3, 0, 0]] * 2)),
        (200, {"action": "kept", "reason": "lb within target"}, "unchanged"),
        (200, _placed([[0, 1, 2, 3]] * 2, (2, 2)), "slots_per_gpu 2 vs the engine's 3 per rank"),
        (200, _placed([[0, 1, 2, 3]] * 2, (3, 3)), "the engine needs (2, 6)"),
        (200, _placed([[0, 1, 2, 2, 0, 0]] * 2), "does not place each"),
        (200, _placed([[0, 1, 2, 3, 0.5, 0]] * 2), "without an integer phy2log"),  # not cast to expert 0
        (200, _placed([[0, 1, 2, 3, 0], [0, 1]]), "without an integer phy2log"),
        # the same [L, P] for another cluster: GPUs, slots per GPU, or both, named
        (200, _placed([[0, 1, 2, 3, 0, 0]] * 2, (2, 2, 2)), "(num_gpus 3 vs the engine's 2 ranks, slots_per_gpu 2 vs "
                                                           "the engine's 3 per rank): set the deployment's cluster"),
        (200, _placed([[0, 1, 2, 3, 0, 0]] * 2, (6,)), "num_gpus 1 vs the engine's 2 ranks, slots_per_gpu 6 vs"),
        (200, _placed([[0, 1, 2, 3, 0, 0]] * 2, (2, 4)), "(slots_per_gpu [2, 4] vs the engine's 3 per rank)"),
        (200, _placed([[0, 1, 2, 3, 0, 0]] * 2, num_gpus=3), "(num_gpus 3 (slots_per_gpu lists 2) vs the engine's 2"),
        (200, {"result": {"placement": {"phy2log": [[0, 1, 2, 3, 0, 0]] * 2}}}, "slots_per_gpu None is not a list"),
        (404, {"detail": "no deployment"}, "answered 404"),
        (503, {"detail": "queue full"}, "answered 503: queue full"),
    ],
)
def test_service_answers_are_checked(status: int, body: Any, expected: Any) -> None:
    settings = core.Settings(service_url="http://svc", deployment="prod", api_key="k")
    answer = core.post_window(np.ones((2, 4)), 6, 2, settings, client=_answering(status, body))
    if isinstance(expected, np.ndarray):
        assert isinstance(answer, np.ndarray) and np.array_equal(answer, expected)
    else:
        assert isinstance(answer, str) and expected in answer


def test_remote_placement_for_another_cluster_shape_is_not_used(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment of 4 GPUs x 4 slots answers a [L, 16] map, the shape of an engine with 16 ranks of one slot:
    the engine gets a local solve and a WARNING naming the fields that disagree; with 4 ranks it gets the map."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-shape", monkeypatch)
    weight = torch.from_numpy(np.random.default_rng(1).pareto(1.0, size=(4, 8)) * 100)
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        out = EplbPolicy.rebalance_experts(weight, 16, 1, 1, 16)
    (record,) = [r for r in caplog.records if r.name == "vllm.eplb_plugin"]
    assert record.levelno == logging.WARNING and "remote failed, solved locally" in record.message
    assert "num_gpus 4 vs the engine's 16 ranks, slots_per_gpu 4 vs the engine's 1 per rank" in record.message
    monkeypatch.delenv("EPLB_SERVICE_URL")
    local = EplbPolicy.rebalance_experts(weight, 16, 1, 1, 16)
    assert out.tolist() == local.tolist()
    remote = np.asarray(httpx.get(f"{base}/deployments/plugin-shape", timeout=60).json()["placement"]["phy2log"])
    assert remote.shape == out.shape  # what the plug-in used as-is before: balanced for 4 GPUs, not for 16
    lb = core.layer_lb(weight.numpy(), out.numpy(), 16).mean(), core.layer_lb(weight.numpy(), remote, 16).mean()
    assert lb[0] < lb[1]
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        served = EplbPolicy.rebalance_experts(weight, 16, 1, 1, 4)
    assert "eplb policy (remote): placement from" in caplog.text and "solved locally" not in caplog.text
    current = httpx.get(f"{base}/deployments/plugin-shape", timeout=60).json()
    assert served.tolist() == current["placement"]["phy2log"]


def test_remote_deployment_name_is_one_path_segment(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EPLB_DEPLOYMENT is escaped and checked: a name with '/..' or '#' in it does not send the window to another
    deployment (httpx resolves 'decoy/../plugin-target' to plugin-target; '#' starts a fragment)."""
    base = server_factory()
    config = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4, "slots_per_gpu": 4}, "solver": "greedy"}
    assert httpx.put(f"{base}/deployments/plugin-target", json=config, timeout=60).status_code in (200, 201)
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    weight = torch.from_numpy(np.random.default_rng(2).pareto(1.0, size=(4, 8)) * 100)
    for name in ("decoy/../plugin-target", "plugin-target#x", "../deployments/plugin-target"):
        monkeypatch.setenv("EPLB_DEPLOYMENT", name)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
            EplbPolicy.rebalance_experts(weight, 16, 1, 1, 4)
        assert f"solved locally: EPLB_DEPLOYMENT={name!r} is no deployment name the service can have" in caplog.text
    assert httpx.get(f"{base}/deployments/plugin-target", timeout=60).json()["windows"] == 0
    assert vars(core)["is_deployment_name"] is is_deployment_name and NAME is DEPLOYMENT_NAME  # one rule, eplb.rules
    with pytest.raises(EplbError, match=re.escape(repr("victim\n"))):  # '$' matched before a trailing newline
        check_name("victim\n")


def test_environment_errors_are_one_line() -> None:
    for env, word in (({"EPLB_MAX_MOVES": "many"}, "EPLB_MAX_MOVES"), ({"EPLB_MAX_MOVES": "-1"}, "EPLB_MAX_MOVES must"),
                      ({"EPLB_SERVICE_TIMEOUT_S": "0"}, "above 0")):
        with pytest.raises(core.PolicyInputError, match=word):
            core.Settings.from_env(env)
    assert core.Settings.from_env({"EPLB_SERVICE_URL": "http://h:1/", "EPLB_DEPLOYMENT": "d"}).service_url == "http://h:1"


@pytest.mark.parametrize(("key", "said"), [
    ("ключ", "has a character that is not printable ASCII (character 1 of 4)"),  # was UnicodeEncodeError in httpx
    ("s3cret\n", "ends with a newline: HTTP strips"),
    ("   ", "is blank"),
])
def test_an_api_key_no_request_can_carry_is_refused_naming_the_variable_not_the_key(key: str, said: str) -> None:
    """The service's and the Python client's rule (`eplb.rules.api_key_refusal`): a key no header carries."""
    with pytest.raises(core.PolicyInputError) as refused:
        core.Settings.from_env({"EPLB_SERVICE_URL": "http://h:1", "EPLB_DEPLOYMENT": "d", "EPLB_API_KEY": key})
    message = str(refused.value)
    assert message.startswith(f"EPLB_API_KEY (not shown) {said}")
    assert not key.strip() or key.strip() not in message


@pytest.mark.parametrize("nodes", [1, 4])
def test_without_a_budget_a_rebalance_never_costs_balance(nodes: int) -> None:
    """Hierarchical edits cannot move a group to another node; when that costs more than 1% of lb, the fresh
    (DeepSeek-equal) placement with slot keeping is used instead."""
    settings = core.Settings()
    old = core.rebalance(PREFILL, 288, 8, nodes, 32, settings=settings).phy2log
    result = core.rebalance(DECODE, 288, 8, nodes, 32, old=old, settings=settings)
    fresh = core.rebalance(DECODE, 288, 8, nodes, 32, settings=settings).phy2log
    kept_lb = core.layer_lb(DECODE, result.phy2log, 32).mean()
    assert kept_lb <= core.INCREMENTAL_LB_TOLERANCE * core.layer_lb(DECODE, fresh, 32).mean()
    assert core.moves(result.phy2log, old, 32).sum() < core.moves(fresh, old, 32).sum()


# --- the deployment's serving placement after refusals and failures ------------------------------------------------


def _history(base: str, name: str) -> list[dict[str, Any]]:
    """The deployment's history entries, oldest first."""
    page = httpx.get(f"{base}/deployments/{name}/history", params={"limit": 100}, timeout=60).json()
    return list(reversed(page["entries"]))


def _current(base: str, name: str) -> dict[str, Any]:
    deployment: dict[str, Any] = httpx.get(f"{base}/deployments/{name}", timeout=60).json()
    return deployment


def test_a_refused_placement_leaves_the_engines_map_and_is_not_recorded_as_applied(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine (4 ranks x 4 slots) serves the deployment's placement; the deployment is then changed to 2 GPUs x 8
    slots (a [L, 16] map too): it refuses the engine's map the windows carry (a 422 naming current_placement), so the
    engine keeps its map as it was (a WARNING naming both shapes), and nothing is stored: no window, no placement.
    Set back to 4 x 4, the next window records the engine's map, rebalances from it, and the engine serves that."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-refused", monkeypatch)
    rng = np.random.default_rng(5)
    windows = [torch.from_numpy(rng.pareto(1.0, size=(4, 8)) * 100) for _ in range(4)]
    first = EplbPolicy.rebalance_experts(windows[0], 16, 1, 1, 4)
    assert first.tolist() == _current(base, "plugin-refused")["placement"]["phy2log"]
    other = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 2, "slots_per_gpu": 8}, "solver": "greedy",
             "policy": {"trigger": "periodic"}}
    assert httpx.put(f"{base}/deployments/plugin-refused", json=other, timeout=60).status_code == 200
    for window in windows[1:3]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
            out = EplbPolicy.rebalance_experts(window, 16, 1, 1, 4, first.clone())
        assert out.tolist() == first.tolist()  # the engine's expert map is unchanged
        (record,) = [r for r in caplog.records if r.name == "vllm.eplb_plugin"]
        assert record.levelno == logging.WARNING and "eplb policy (kept): the serving placement stays" in record.message
        assert "current_placement: 4 GPUs, 4 slots each, the deployment has 2 GPUs, 8 slots each" in record.message
    deployment = _current(base, "plugin-refused")
    assert deployment["windows"] == 1 and deployment.get("placement") is None  # the PUT dropped it; nothing since
    assert [e["action"] for e in _history(base, "plugin-refused")] == ["placed"]
    config = {**other, "cluster": {"num_gpus": 4, "slots_per_gpu": 4}}
    assert httpx.put(f"{base}/deployments/plugin-refused", json=config, timeout=60).status_code == 200
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        served = EplbPolicy.rebalance_experts(windows[3], 16, 1, 1, 4, first.clone())
    assert "eplb policy (remote): placement from" in caplog.text and "WARNING" not in caplog.text
    entries = _history(base, "plugin-refused")
    assert [e["action"] for e in entries[1:]] == ["applied", "rebalanced"]  # from the map serving, not afresh
    assert entries[1]["seq"] == 1 and entries[2]["lb_before"] == pytest.approx(
        core.layer_lb(windows[3].numpy(), first.numpy(), 4).mean(), abs=1e-5)
    assert served.tolist() == _current(base, "plugin-refused")["placement"]["phy2log"]
    assert stays_in_old_slot(first.numpy(), served.numpy(), 4)


def _relay(base: str, alter: Callable[[httpx.Request, httpx.Response], httpx.Response]) -> httpx.Client:
    """An httpx client whose every request goes to the real service at `base`; `alter(request, answer)` may change
    the answer (or raise, as a lost connection does)."""
    real = httpx.Client(base_url=base, timeout=60)

    def handler(request: httpx.Request) -> httpx.Response:
        answer = real.request(request.method, request.url.raw_path.decode(), content=request.content,
                              headers={"content-type": "application/json"})
        return alter(request, httpx.Response(answer.status_code, content=answer.content, headers=answer.headers))

    return httpx.Client(transport=httpx.MockTransport(handler), base_url=base)


def _windows_only(change: Callable[[httpx.Response], httpx.Response]) -> Callable[..., httpx.Response]:
    def alter(request: httpx.Request, answer: httpx.Response) -> httpx.Response:
        return change(answer) if request.url.path.endswith("/windows") else answer

    return alter


def _rebalance(weight: np.ndarray, old: np.ndarray | None, base: str, name: str,
               alter: Callable[..., httpx.Response] = lambda request, answer: answer) -> core.Rebalanced:
    settings = core.Settings(service_url=base, deployment=name)
    with _relay(base, alter) as client:
        return core.rebalance(weight, 16, 1, 1, 4, old, settings, client=client)


def test_a_refused_placement_is_replaced_by_the_serving_one_on_the_deployment(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service rebalances and stores its placement as serving, but its answer reaches the engine without one
    expert (a broken proxy): the engine keeps its map and sends nothing more; the next window carries that map, which
    the deployment records as serving (an `applied` entry, the refused placement never reported) before judging the
    window against it and rebalancing from it."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-relay", monkeypatch)
    rng = np.random.default_rng(6)
    windows = [rng.pareto(1.0, size=(4, 8)) * 100 for _ in range(3)]
    first = _rebalance(windows[0], None, base, "plugin-relay")
    assert first.source == "remote" and not first.fell_back

    def drop_an_expert(answer: httpx.Response) -> httpx.Response:
        body = answer.json()
        body["result"]["placement"]["phy2log"][0] = [0] * 16
        return httpx.Response(200, json=body)

    refused = _rebalance(windows[1], first.phy2log, base, "plugin-relay", _windows_only(drop_an_expert))
    assert refused.source == "kept" and refused.fell_back and "does not place each of the 8 experts" in refused.how
    assert np.array_equal(refused.phy2log, first.phy2log)
    assert [e["action"] for e in _history(base, "plugin-relay")] == ["placed", "rebalanced"]
    good = _rebalance(windows[2], refused.phy2log, base, "plugin-relay")
    entries = _history(base, "plugin-relay")
    assert [e["action"] for e in entries[2:]] == ["applied", "rebalanced"]
    assert entries[2]["moves"] == entries[1]["moves"] > 0  # back from the refused placement to the serving one
    assert entries[3]["lb_before"] == pytest.approx(core.layer_lb(windows[2], first.phy2log, 4).mean(), abs=1e-5)
    assert good.source == "remote" and _current(base, "plugin-relay")["placement"]["phy2log"] == good.phy2log.tolist()


def test_after_an_error_status_the_deployment_is_told_what_serves(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 to the window (a proxy's: the service behind it rebalanced): the engine solves locally from its map; the
    next window carries that local placement, which the deployment records before judging the window against it."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-busy", monkeypatch)
    rng = np.random.default_rng(12)
    windows = [rng.pareto(1.0, size=(4, 8)) * 100 for _ in range(3)]
    first = _rebalance(windows[0], None, base, "plugin-busy")
    busy = _windows_only(lambda answer: httpx.Response(503, json={"detail": "every solver worker is busy"}))
    local = _rebalance(windows[1], first.phy2log, base, "plugin-busy", busy)
    assert local.source == "local" and local.fell_back and "answered 503: every solver worker is busy" in local.how
    assert not np.array_equal(local.phy2log, first.phy2log)
    assert [e["action"] for e in _history(base, "plugin-busy")] == ["placed", "rebalanced"]
    # the scenario: the local placement is not the one the deployment holds (else applying it records nothing)
    assert _current(base, "plugin-busy")["placement"]["phy2log"] != local.phy2log.tolist()
    _rebalance(windows[2], local.phy2log, base, "plugin-busy")
    entries = _history(base, "plugin-busy")
    assert [e["action"] for e in entries[2:]] == ["applied", "rebalanced"]
    assert entries[3]["lb_before"] == pytest.approx(core.layer_lb(windows[2], local.phy2log, 4).mean(), abs=1e-5)


def test_a_lost_answer_is_made_good_before_the_next_window(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service rebalanced, but its answer never arrived (the read timed out): the engine solves locally and
    asks nothing more of a service that does not answer; the next window carries the map serving, which the
    deployment, holding the lost placement, records first and judges the window against."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-lost", monkeypatch)
    rng = np.random.default_rng(12)
    windows = [rng.pareto(1.0, size=(4, 8)) * 100 for _ in range(3)]
    first = _rebalance(windows[0], None, base, "plugin-lost")

    def lost(answer: httpx.Response) -> httpx.Response:
        raise httpx.ReadTimeout("timed out")

    local = _rebalance(windows[1], first.phy2log, base, "plugin-lost", _windows_only(lost))
    assert local.source == "local" and local.fell_back and "no answer within" in local.how
    lost_placement = _current(base, "plugin-lost")["placement"]["phy2log"]
    assert [e["action"] for e in _history(base, "plugin-lost")] == ["placed", "rebalanced"]
    assert lost_placement != local.phy2log.tolist()
    _rebalance(windows[2], local.phy2log, base, "plugin-lost")
    entries = _history(base, "plugin-lost")
    assert [e["action"] for e in entries[2:4]] == ["applied", "rebalanced"]
    assert entries[3]["lb_before"] == pytest.approx(core.layer_lb(windows[2], local.phy2log, 4).mean(), abs=1e-5)


def test_a_window_that_fails_once_is_sent_again_and_every_rank_gets_the_services_answer(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose window failed fell back to a local solve and served another map than the ranks the service
    answered. The plug-in sends the same request again for what a retry can mend (eplb.retry.RETRIES, within
    EPLB_SERVICE_TIMEOUT_S), through a real proxy in front of the service: a connection reset before an answer, then a
    502: the third attempt gets the service's placement. A 504, then a 500 (a solve that crashed): the 500 is not sent
    again (it would solve again under the deployment's lock for every rank); the local solve, its reason naming both.
    No answer in time, the first attempt having been processed: the retry gets that window's stored answer, the one a
    rank that did not fail gets: one window, one rebalance."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-retry", monkeypatch)
    monkeypatch.setattr(retry, "BACKOFF_S", (0.01, 0.01))
    rng = np.random.default_rng(13)
    windows = [rng.pareto(1.0, size=(4, 8)) * 100 for _ in range(3)]
    settings = core.Settings(service_url="", deployment="plugin-retry", timeout_s=60.0)  # a first solve may be slow

    with proxy(base, {1: "drop", 2: 502}) as (url, log):
        first = core.rebalance(windows[0], 16, 1, 1, 4, INITIAL.copy(), replace(settings, service_url=url))
    assert first.source == "remote" and not first.fell_back, first.how
    assert log == [(1, "drop"), (2, "502"), (3, "forwarded")]
    assert first.phy2log.tolist() == _current(base, "plugin-retry")["placement"]["phy2log"]
    assert [e["action"] for e in _history(base, "plugin-retry")] == ["applied", "rebalanced"]

    with proxy(base, {1: 504, 2: 500}) as (url, log):
        local = core.rebalance(windows[1], 16, 1, 1, 4, first.phy2log.copy(), replace(settings, service_url=url))
    assert local.source == "local" and local.fell_back and log == [(1, "504"), (2, "500")]
    assert "windows answered 500: the proxy's 500 (attempt 2, after answered 504: the proxy's 504)" in local.how
    assert len(_history(base, "plugin-retry")) == 2

    # the first attempt waits 0.5 s, the retry the rest; the proxy answers the first once the retry has come
    monkeypatch.setattr(retry, "reserve_s", lambda timeout_s: timeout_s - 0.5)
    with proxy(base, {1: "late"}) as (url, log):
        retried = core.rebalance(windows[2], 16, 1, 1, 4, local.phy2log.copy(), replace(settings, service_url=url))
    assert retried.source == "remote" and not retried.fell_back, retried.how
    assert log == [(1, "late"), (2, "forwarded")]
    direct = core.rebalance(windows[2], 16, 1, 1, 4, local.phy2log.copy(), replace(settings, service_url=base))
    assert np.array_equal(retried.phy2log, direct.phy2log)  # the rank that timed out serves the others' map
    assert [e["action"] for e in _history(base, "plugin-retry")] == ["applied", "rebalanced", "applied", "rebalanced"]


def test_a_service_that_never_answers_in_time_is_waited_for_once_then_retried_in_the_reserve(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt waits all of EPLB_SERVICE_TIMEOUT_S but the reserve for one retry (retry.reserve_s: a quarter
    of 1.6 s here, retry.RESERVE_S = 1 s at most), the retry the rest; no third attempt, no time being left: the local
    solve within the timeout, its reason giving each attempt's wait."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-silent", monkeypatch)
    monkeypatch.setattr(retry, "BACKOFF_S", (0.01, 0.01))
    weight = np.random.default_rng(14).pareto(1.0, size=(4, 8)) * 100
    with proxy(base, {1: "silent", 2: "silent", 3: "silent"}) as (url, log):
        started = time.monotonic()
        local = core.rebalance(weight, 16, 1, 1, 4, INITIAL.copy(),
                               core.Settings(service_url=url, deployment="plugin-silent", timeout_s=1.6))
        took = time.monotonic() - started
    assert local.source == "local" and local.fell_back, local.how
    waits = r"windows failed 2 attempts within 1\.6 s: no answer within 1\.2 s, then no answer within 0\.[0-3]\d* s"
    assert re.search(waits, local.how), local.how
    assert log == [(1, "silent"), (2, "silent")] and took < 30  # a hang guard, not a measure


def test_a_placement_relabelled_to_keep_slots_is_what_the_deployment_holds(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine serves its map relabelled (every expert on another GPU number than the deployment holds): the
    window carries it, the deployment records it and rebalances from it, keeping its slots, and the engine serves
    that answer as it is, which the deployment holds."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-relabel", monkeypatch)
    rng = np.random.default_rng(9)
    windows = [rng.pareto(1.0, size=(4, 8)) * 100 for _ in range(2)]
    first = _rebalance(windows[0], None, base, "plugin-relabel")
    rotated = np.roll(first.phy2log, 4, axis=1)  # the same GPUs, numbered one on: every expert moves
    served = _rebalance(windows[1], rotated, base, "plugin-relabel")
    actions = [e["action"] for e in _history(base, "plugin-relabel")]
    assert actions[:2] == ["placed", "applied"]  # the engine serves `rotated`, not the placement first answered
    assert _current(base, "plugin-relabel")["placement"]["phy2log"] == served.phy2log.tolist()
    assert stays_in_old_slot(rotated, served.phy2log, 4)


def test_kept_without_the_engines_map_serves_the_deployments(server_factory: Callable[..., str]) -> None:
    """An engine that passes no current map (vLLM before old_global_expert_indices) and is answered `kept` serves
    the deployment's placement, which is what the service judged, not a local solve it knows nothing of."""
    base = server_factory()
    config = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4, "slots_per_gpu": 4}, "solver": "greedy",
              "policy": {"trigger": "periodic", "every": 5}}
    assert httpx.put(f"{base}/deployments/plugin-kept", json=config, timeout=60).status_code == 201
    rng = np.random.default_rng(10)
    first = _rebalance(rng.pareto(1.0, size=(4, 8)) * 100, None, base, "plugin-kept")
    kept = _rebalance(rng.pareto(1.0, size=(4, 8)) * 100, None, base, "plugin-kept")
    assert kept.source == "remote" and not kept.fell_back and "kept the current placement" in kept.how
    assert np.array_equal(kept.phy2log, first.phy2log)
    assert [e["action"] for e in _history(base, "plugin-kept")] == ["placed", "kept"]


def test_an_engine_that_passes_no_map_reports_its_fallbacks_as_one_that_passes_it(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM before old_global_expert_indices passes no map: after a fallback (a 503: a local solve; an answer without
    one expert: refused) its next window went alone, so the deployment judged it against, and rebalanced from, a
    placement nobody served. The plug-in now sends the map it answered last for that deployment and cluster as the
    engine's, so each fallback reaches the deployment as with a map: an `applied` entry of what serves, the window
    judged on it; a refusal keeps that map serving (`kept`), as with a map, not a fresh local solve."""
    base = server_factory()
    remote_mixtral_deployment(base, "plugin-no-map", monkeypatch)
    rng = np.random.default_rng(15)
    windows = [torch.from_numpy(rng.pareto(1.0, size=(4, 8)) * 100) for _ in range(5)]
    first = EplbPolicy.rebalance_experts(windows[0], 16, 1, 1, 4)
    busy = _windows_only(lambda answer: httpx.Response(503, json={"detail": "every solver worker is busy"}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        local = _rebalance(windows[1].numpy(), None, base, "plugin-no-map", busy)
    assert local.source == "local" and local.fell_back and "answered 503" in local.how
    assert not np.array_equal(local.phy2log, first.numpy())
    assert stays_in_old_slot(first.numpy(), local.phy2log, 4)  # a local solve from the map served, as with one
    second = EplbPolicy.rebalance_experts(windows[2], 16, 1, 1, 4)
    entries = _history(base, "plugin-no-map")
    assert [e["action"] for e in entries] == ["placed", "rebalanced", "applied", "rebalanced"]
    assert entries[2]["reason"] == "sent with the window as current_placement"
    assert entries[3]["lb_before"] == pytest.approx(core.layer_lb(windows[2].numpy(), local.phy2log, 4).mean(),
                                                    abs=1e-5)
    assert stays_in_old_slot(local.phy2log, second.numpy(), 4)

    def drop_an_expert(answer: httpx.Response) -> httpx.Response:
        body = answer.json()
        body["result"]["placement"]["phy2log"][0] = [0] * 16
        return httpx.Response(200, json=body)

    refused = _rebalance(windows[3].numpy(), None, base, "plugin-no-map", _windows_only(drop_an_expert))
    assert refused.source == "kept" and refused.fell_back and "does not place each of the 8 experts" in refused.how
    assert np.array_equal(refused.phy2log, second.numpy())  # what serves stays
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
        EplbPolicy.rebalance_experts(windows[4], 16, 1, 1, 4)
    assert "eplb policy (remote): placement from" in caplog.text
    entries = _history(base, "plugin-no-map")
    assert [e["action"] for e in entries[4:]] == ["rebalanced", "applied", "rebalanced"]
    assert entries[6]["lb_before"] == pytest.approx(core.layer_lb(windows[4].numpy(), second.numpy(), 4).mean(),
                                                    abs=1e-5)


# --- every EP rank calls the policy ---------------------------------------------------------------------------------
# vLLM's EplbState.rearrange all-reduces the load window, then every rank calls the policy with it and with the same
# physical_to_logical_map (SGLang's EPLBManager.rebalance likewise, per rank): in remote mode every rank sends it.

MIXTRAL_4X4 = {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4, "slots_per_gpu": 4}, "solver": "greedy"}
INITIAL = np.tile(np.arange(8), (4, 2))  # [4 layers, 16 slots]: vLLM's first map, each expert twice, by id


def _on_ranks(ranks: int, call: Callable[[int], Any]) -> list[Any]:
    """`call(rank)` on `ranks` threads released together (the ranks reach the rebalance at once); answers by rank."""
    answers: list[Any] = [None] * ranks
    barrier = threading.Barrier(ranks)

    def run(rank: int) -> None:
        barrier.wait()
        answers[rank] = call(rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_every_rank_calling_the_policy_gets_one_placement(
    server_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Four ranks call the plug-in with the same window and map at once, three rebalances running: every rank gets
    the same map each time (kept, rebalanced, kept: periodic every 2), and the deployment records one window per
    rebalance, one rebalance, and the engine's first map once."""
    base = server_factory()
    config = {**MIXTRAL_4X4, "policy": {"trigger": "periodic", "every": 2}}
    assert httpx.put(f"{base}/deployments/plugin-ranks", json=config, timeout=60).status_code == 201
    monkeypatch.setenv("EPLB_SERVICE_URL", base)
    monkeypatch.setenv("EPLB_DEPLOYMENT", "plugin-ranks")
    monkeypatch.setenv("EPLB_SERVICE_TIMEOUT_S", "60")
    rng = np.random.default_rng(11)
    old = torch.from_numpy(INITIAL)
    expected = [["applied", "kept"], ["rebalanced"], ["kept"]]
    for windows, actions in enumerate(expected, start=1):
        weight = torch.from_numpy(rng.pareto(1.0, size=(4, 8)) * 100)
        caplog.clear()
        def rank(_: int, weight: torch.Tensor = weight, old: torch.Tensor = old) -> Any:
            return EplbPolicy.rebalance_experts(weight.clone(), 16, 1, 1, 4, old.clone())

        with caplog.at_level(logging.INFO, logger="vllm.eplb_plugin"):
            maps = _on_ranks(4, rank)
        assert all(m.tolist() == maps[0].tolist() for m in maps), [m.tolist() for m in maps]
        lines = [r for r in caplog.records if r.name == "vllm.eplb_plugin"]
        assert len(lines) == 4 and all(r.levelno == logging.INFO and "(remote)" in r.message for r in lines)
        deployment = _current(base, "plugin-ranks")
        assert deployment["windows"] == windows and deployment["placement"]["phy2log"] == maps[0].tolist()
        assert [e["action"] for e in _history(base, "plugin-ranks")][-len(actions):] == actions
        if actions == ["rebalanced"]:
            assert not np.array_equal(maps[0].numpy(), old.numpy()) and stays_in_old_slot(old.numpy(),
                                                                                           maps[0].numpy(), 4)
        else:
            assert maps[0].tolist() == old.tolist()
        old = maps[0]
    assert len(_history(base, "plugin-ranks")) == 4


def test_ranks_whose_requests_failed_serve_the_answer_the_other_ranks_got(
    server_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Four EP ranks, real processes in one gloo group (vLLM's EPLB group), call the policy with the same window and
    map; ranks 0 and 2 cannot reach the service (connection refused, retried, then the local solve), ranks 1 and 3
    get its answer. Each rank served its own answer, so 0 and 2 served another map than 1 and 3, and vLLM moves the
    weights by each rank's map. Every rank now serves rank 1's, the service's, also log2phy and logcnt; ranks 0 and
    2 log a WARNING naming it and their own failure; a process a rank forks runs no collective."""
    base = server_factory()
    config = {**MIXTRAL_4X4, "policy": {"trigger": "periodic"}}
    assert httpx.put(f"{base}/deployments/split-ranks", json=config, timeout=60).status_code == 201
    weight = np.random.default_rng(13).pareto(1.0, size=(4, 8)) * 100
    dead = "http://127.0.0.1:9"
    call = {"weight": weight.tolist(), "num_replicas": 16, "num_groups": 1, "num_nodes": 1, "num_ranks": 4,
            "old": INITIAL.tolist()}
    answers = run_ranks("vllm", [dead, base, dead, base], {"EPLB_DEPLOYMENT": "split-ranks",
                                                           "EPLB_SERVICE_TIMEOUT_S": "60"}, call, tmp_path)
    assert all(a["maps"] == answers[1]["maps"] for a in answers), [a["maps"][0] for a in answers]
    assert answers[1]["maps"][0] == _current(base, "split-ranks")["placement"]["phy2log"] != INITIAL.tolist()
    for r in (0, 2):
        ((level, line),) = answers[r]["logs"]
        assert level == "WARNING" and line.startswith("eplb policy (rank 1): the map of EP rank 1, which every rank "
                                                      "serves; this rank's own (local): ") and "remote failed" in line
    for r in (1, 3):
        assert answers[r]["logs"] == [["INFO", f"eplb policy (remote): placement from {base} deployment "
                                                "'split-ranks'"]]
    assert not any(a["forked_group"] for a in answers)


def test_the_ranks_agree_over_vllms_eplb_group_or_its_ep_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Newer vLLM moves weights over get_eplb_group(), older over get_ep_group(): the plug-in agrees over the one the
    installed vLLM has; without torch.distributed (one process) there is nothing to agree on."""
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_ep_group = lambda: types.SimpleNamespace(cpu_group="ep")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    assert plugin.eplb_group() == "ep"
    state.get_eplb_group = lambda: types.SimpleNamespace(cpu_group="eplb")  # type: ignore[attr-defined]
    assert plugin.eplb_group() == "eplb"
    assert not torch.distributed.is_initialized() and core.engine_group(plugin.eplb_group) is None


def _replicas(stack: ExitStack, db_url: str, count: int) -> list[str]:
    """The URLs of `count` `eplb serve` replicas on the database at `db_url`, started together (each start is mostly
    imports) and stopped together by `stack` (a stop waits for the replica's solver worker: all are terminated first,
    then waited for)."""
    managers = [replica(db_url) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(cm.__enter__) for cm in managers]
    started = [(cm, f.result()) for cm, f in zip(managers, futures, strict=True) if f.exception() is None]
    for cm, _ in started:
        stack.push(cm)

    def terminate() -> None:  # runs first: every replica stops at once
        for _, (_, proc) in started:
            if proc.poll() is None:
                proc.terminate()

    stack.callback(terminate)
    for f in futures:
        f.result()  # the first replica that did not start, raised
    return [base for _, (base, _) in started]


def test_ranks_on_two_replicas_get_one_placement_per_window(postgres: PostgresCluster) -> None:
    """Four ranks, two sending to each of two `eplb serve` replicas on one PostgreSQL database (its FOR UPDATE lock):
    one answer per window for every rank, one window and one rebalance stored each time. A duplicate reaching the
    replica process that has not seen its window (the ranks sent it to the other) gets the stored answer; the first
    window's content sent again after a new placement (an engine restarted on its first map) is a new window, and so
    is a window after an applied placement that changed what serves."""
    with ExitStack() as stack:
        bases = _replicas(stack, postgres.new_database(), 2)
        assert httpx.put(f"{bases[0]}/deployments/ranks", json={**MIXTRAL_4X4, "policy": {"trigger": "periodic"}},
                         timeout=60).status_code == 201
        rng = np.random.default_rng(12)
        windows = [rng.pareto(1.0, size=(4, 8)) * 100 for _ in range(2)]

        def on_ranks(weight: np.ndarray, old: np.ndarray, replicas: tuple[str, ...] = tuple(bases)) -> np.ndarray:
            def rank(i: int) -> core.Rebalanced:  # over the replicas in turn
                settings = core.Settings(service_url=replicas[i % len(replicas)], deployment="ranks", timeout_s=60)
                return core.rebalance(weight, 16, 1, 1, 4, old.copy(), settings)

            answers = _on_ranks(4, rank)
            assert all(a.source == "remote" and not a.fell_back for a in answers), [a.how for a in answers]
            assert all(np.array_equal(a.phy2log, answers[0].phy2log) for a in answers)
            return np.asarray(answers[0].phy2log)

        first = on_ranks(windows[0], INITIAL)
        assert [e["action"] for e in _history(bases[1], "ranks")] == ["applied", "rebalanced"]
        second = on_ranks(windows[1], first, (bases[0],))  # every rank at one replica
        assert [e["action"] for e in _history(bases[1], "ranks")] == ["applied", "rebalanced", "rebalanced"]
        assert _current(bases[0], "ranks")["placement"]["phy2log"] == second.tolist()
        settings = core.Settings(service_url=bases[1], deployment="ranks", timeout_s=60)  # a late rank, at the other
        assert np.array_equal(core.rebalance(windows[1], 16, 1, 1, 4, first.copy(), settings).phy2log, second)
        assert _current(bases[0], "ranks")["windows"] == 2
        again = on_ranks(windows[0], INITIAL)  # the first window's content, after a new placement: a new window
        entries = _history(bases[0], "ranks")
        assert [e["action"] for e in entries[3:]] == ["applied", "rebalanced"] and entries[-1]["seq"] == 3
        assert np.array_equal(again, first)  # rebalanced from the same map on the same window: the same answer
        served = {"phy2log": second.tolist(), "slots_per_gpu": [4] * 4}
        assert httpx.post(f"{bases[0]}/deployments/ranks/placement", json={"placement": served},
                          timeout=60).status_code == 200
        on_ranks(windows[0], INITIAL)  # what serves changed since that window: it is processed again
        assert [e["action"] for e in _history(bases[0], "ranks")[5:]] == ["applied", "applied", "rebalanced"]
        assert _current(bases[0], "ranks")["windows"] == 4


def test_the_map_remembered_for_an_engine_without_one_is_of_its_own_shape() -> None:
    """core.last_served answers by deployment and the whole cluster shape, experts included: a map answered for
    8 experts is never sent as the serving map of a model of 16 with the same layers and slots."""
    settings = core.Settings(service_url="http://127.0.0.1:9", deployment="shape")
    core.forget_served()
    try:
        served = np.tile(np.arange(10) % 8, (2, 1))
        with core._SERVED_LOCK:
            core._SERVED[core._served_key(settings, (2, 8), 10, 2)] = served
        remembered = core.last_served(settings, (2, 8), 10, 2)
        assert remembered is not None and np.array_equal(remembered, served)
        assert core.last_served(settings, (2, 16), 10, 2) is None
        assert core.last_served(settings, (3, 8), 10, 2) is None
    finally:
        core.forget_served()
