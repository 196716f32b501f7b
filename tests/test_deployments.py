"""Deployments on real databases (every test runs on a SQLite file and on a throwaway PostgreSQL): register,
windows through each trigger, history pages, applied placements, retire, one rebalance for concurrent windows,
and the HTTP routes over the same database."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from eplb import deployments as dep
from eplb.cost.migration import MigrationSpec
from eplb.errors import EplbError, FieldError
from eplb.placement import Placement
from eplb.schemas import PlacementOut
from eplb.solve import evaluate, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS
from eplb.store import DeploymentRow, Store, open_store
from solvers import registry
from solvers.migration import count_moves
from solvers.registry import Options
from tests.db_fixtures import PostgresCluster, db_url_fixture, postgres_fixture  # noqa: F401

MODEL = "deepseek-v2-lite"  # 64 experts
EXPERTS = MODEL_PRESETS[MODEL].num_experts
LAYERS = 4


def window(phase: int, seed: int = 0) -> list[list[float]]:
    """[LAYERS][64] tokens: a few hot experts, which ones set by `phase` (a new phase = the load moved)."""
    rng = np.random.default_rng(seed)
    base = 1000.0 / (1.0 + np.arange(EXPERTS)) ** 1.2
    rows = []
    for layer in range(LAYERS):
        order = np.random.default_rng(1000 * phase + layer).permutation(EXPERTS)
        rows.append(np.floor(base[order] * 100 * rng.uniform(0.95, 1.05, EXPERTS)).tolist())
    return rows


def config(**policy: Any) -> dep.DeploymentConfig:
    return dep.DeploymentConfig.model_validate({
        "model": MODEL, "hardware": "h100", "cluster": {"num_gpus": 8, "slots_per_gpu": 10},
        "tokens_per_gpu": 4096.0, "policy": policy,
    })


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.close()


def test_names_are_case_sensitive_on_every_database(store: Store) -> None:
    """docs/api.md says so: `Prod` and `prod` are two deployments, and `PROD` is none of them (SQLite's and
    PostgreSQL's comparisons of the primary key alike)."""
    for name in ("Prod", "prod"):
        assert dep.register(store, name, config())[1]  # both created
    assert sorted(v.name for v in dep.list_all(store)) == ["Prod", "prod"]  # in the database's collation order
    with pytest.raises(dep.NotFound, match="no deployment named 'PROD'"):
        dep.get(store, "PROD")
    dep.retire(store, "Prod")
    assert [v.name for v in dep.list_all(store)] == ["prod"]


def test_register_get_update_list_retire(store: Store) -> None:
    view, created = dep.register(store, "prod-a", config(threshold=1.2))
    assert created and view.placement is None and view.windows == 0
    assert dep.get(store, "prod-a").config.policy.threshold == 1.2
    dep.process_window(store, "prod-a", window(0))
    view, created = dep.register(store, "prod-a", config(threshold=1.3))  # same shape: placement stays
    assert not created and view.placement is not None and view.config.policy.threshold == 1.3
    bigger = config().model_copy(update={"cluster": dep.ClusterShape(num_gpus=8, slots_per_gpu=9)})
    dropped, created = dep.register(store, "prod-a", bigger)  # new slot layout: placement dropped, and said so
    assert not created and dropped.placement is None and dropped.placement_dropped == dep.PLACEMENT_DROPPED
    assert not view.created and view.placement_dropped is None
    dep.register(store, "prod-b", config())
    assert [v.name for v in dep.list_all(store)] == ["prod-a", "prod-b"]
    dep.retire(store, "prod-a")
    with pytest.raises(dep.NotFound, match="no deployment named 'prod-a'"):
        dep.get(store, "prod-a")
    assert dep.history_count(store, "prod-a") == 0
    assert [v.name for v in dep.list_all(store)] == ["prod-b"]


def test_threshold_trigger_places_keeps_and_rebalances(store: Store) -> None:
    dep.register(store, "d", config(trigger="threshold", threshold=1.10))
    first = dep.process_window(store, "d", window(0))
    assert (first.action, first.seq, first.entry.moves) == ("placed", 1, 0)
    assert first.result is not None and first.entry.lb_before is None
    assert first.entry.lb_after is not None and first.entry.lb_after < 1.10
    assert first.result.predicted.lb_mean == pytest.approx(first.entry.lb_after, abs=1e-6)

    same = dep.process_window(store, "d", window(0, seed=1))  # the same hot experts: nothing to gain
    assert same.action == "kept" and same.result is None
    assert same.reason.startswith("threshold: predicted lb") and "<= 1.1" in same.reason
    assert same.entry.lb_before == same.entry.lb_after and same.entry.moves == 0

    moved = dep.process_window(store, "d", window(1))  # the load moved to other experts
    assert moved.action == "rebalanced" and "> 1.1" in moved.reason
    assert moved.entry.lb_before is not None and moved.entry.lb_after is not None
    assert moved.entry.lb_before > 1.10 > moved.entry.lb_after
    assert moved.entry.time_before_us is not None and moved.entry.time_after_us is not None
    assert moved.entry.time_after_us < moved.entry.time_before_us
    assert moved.entry.moves is not None and moved.entry.moves > 0
    assert moved.entry.bytes_moved == moved.entry.moves * MODEL_PRESETS[MODEL].expert_bytes
    assert moved.result is not None and moved.result.moves is not None
    assert moved.result.moves.total == moved.entry.moves
    view = dep.get(store, "d")
    assert view.windows == 3 and view.last_rebalance == 3
    assert view.placement is not None and view.placement.phy2log == moved.result.placement.phy2log


def test_periodic_trigger_counts_windows(store: Store) -> None:
    dep.register(store, "p", config(trigger="periodic", every=2))
    actions = [dep.process_window(store, "p", window(i)).action for i in range(5)]
    assert actions == ["placed", "kept", "rebalanced", "kept", "rebalanced"]
    assert dep.process_window(store, "p", window(9), force=True).reason == "forced by the request"


def test_cost_trigger_weighs_copy_time_against_time_saved(store: Store) -> None:
    decode = {"tokens_per_gpu": 256.0}  # small steps: a rebalance saves little per step
    dep.register(store, "short", config(trigger="cost", steps=1).model_copy(update=decode))
    dep.register(store, "long", config(trigger="cost", steps=10**6).model_copy(update=decode))
    for name in ("short", "long"):
        dep.process_window(store, name, window(0))
    short = dep.process_window(store, "short", window(1))
    long = dep.process_window(store, "long", window(1))
    assert short.action == "kept" and "migration would cost" in short.reason
    assert long.action == "rebalanced" and "migration costs" in long.reason


def test_cost_trigger_charges_the_policys_fixed_stall(store: Store) -> None:
    """The same windows: without a stall the move pays; a stall of an hour per rebalance does not, and the
    reason shows the stall in the charge."""
    dep.register(store, "free", config(trigger="cost", steps=10**6))
    dep.register(store, "stalls", config(trigger="cost", steps=10**6, migration_stall_s=3600.0))
    for name in ("free", "stalls"):
        dep.process_window(store, name, window(0))
    free = dep.process_window(store, "free", window(1))
    stalls = dep.process_window(store, "stalls", window(1))
    assert free.action == "rebalanced" and stalls.action == "kept"
    charge = float(stalls.reason.split("would cost ")[1].split(" ms")[0])
    assert charge >= 3600e3
    with pytest.raises(ValidationError):
        config(trigger="cost", migration_stall_s=-1.0)


def test_cost_trigger_charges_blocking_copies_when_the_policy_says_so(store: Store) -> None:
    """policy.migration = blocking (replay's --migration blocking): serving stops while the copies cross the link,
    so the charge is their time at full link speed, not the overlapped copies' slowdown of the steps served
    meanwhile; and overlapped copies delay the new placement until they land (`eplb.trigger.net_saving`). Over a
    horizon between the two break-evens one of them pays and the other does not: here (decode, the all-to-all
    after the GEMMs) blocking breaks even first, since the overlapped copies take 1 / share as long to land;
    where comm bounds every layer with comm overlapped, the overlapped charge equals the blocking one (the link
    does the same work either way)."""
    from dataclasses import replace

    from eplb.cost.migration import plan_copies, plan_for

    serial = {"solver": "greedy", "tokens_per_gpu": 256.0, "overlap": False}  # decode; greedy: one candidate, the
    # charge the reason shows is its
    overlap_cfg = config(trigger="cost").model_copy(update=serial)
    blocking_cfg = config(trigger="cost", migration="blocking").model_copy(update=serial)
    assert dep.Setup(overlap_cfg).migration.overlap and not dep.Setup(blocking_cfg).migration.overlap
    assert config().policy.migration == "overlap"  # the default, and what a stored config without it reads as

    dep.register(store, "probe", overlap_cfg)  # what both deployments will serve and solve next
    dep.process_window(store, "probe", window(0))
    served = dep.current_placement(store, "probe")
    assert served is not None
    setup = dep.Setup(overlap_cfg)
    loads = np.asarray(window(1), dtype=np.float64)
    moved = setup.solve(solve, loads, served, None)
    before, after = evaluate(loads, served, setup.cost), evaluate(loads, moved.placement, setup.cost)
    assert before.prediction is not None and after.prediction is not None
    saved_per_step = (before.prediction.total_time_us - after.prediction.total_time_us) * 1e-6
    args = (moved.placement.phy2log, served.phy2log, setup.cluster.slots_per_gpu, setup.model.expert_bytes,
            before.prediction)  # fmt: skip
    step_s = before.prediction.total_time_us * 1e-6
    overlapped, span = setup.migration.rebalance_cost(*args).charge_s(step_s)  # span: steps until the copies land
    blocking = replace(setup.migration, overlap=False).rebalance_cost(*args).charge_s(step_s)[0]
    slots = setup.cluster.slots_per_gpu
    copies = plan_copies(plan_for(moved.placement.phy2log, served.phy2log, slots), slots.size, None)[0]
    link_s = float(copies.max()) * setup.model.expert_bytes / HARDWARE_PRESETS["h100"].nvlink_bandwidth
    assert blocking == pytest.approx(link_s)  # the busiest destination's bytes at full NVLink speed
    assert overlapped < blocking  # the comm part of the steps, not the whole of them
    even = {"overlap": overlapped / saved_per_step + span, "blocking": blocking / saved_per_step}  # break-evens
    first, last = sorted(even, key=even.__getitem__)
    assert saved_per_step > 0 and even[last] > even[first] * 1.5 and first == "blocking"
    steps = round((even["overlap"] + even["blocking"]) / 2)

    for name, cfg in (("overlap", overlap_cfg), ("blocking", blocking_cfg)):
        cfg = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"steps": steps})})
        dep.register(store, name, cfg)
        assert dep.process_window(store, name, window(0)).action == "placed"
        now = dep.current_placement(store, name)
        assert now is not None and np.array_equal(now.phy2log, served.phy2log)
    paid = dep.process_window(store, first, window(1))
    stopped = dep.process_window(store, last, window(1))
    assert paid.action == "rebalanced" and paid.entry.moves == int(copies.sum())
    assert stopped.action == "kept" and "migration would cost" in stopped.reason
    charge = {"overlap": overlapped, "blocking": blocking}
    charged_ms = float(stopped.reason.split("would cost ")[1].split(" ms")[0])
    assert charged_ms == pytest.approx(charge[last] * 1e3, abs=1e-3)
    charged_ms = float(paid.reason.split("costs ")[1].split(" ms")[0])
    assert charged_ms == pytest.approx(charge[first] * 1e3, abs=1e-3)
    with pytest.raises(ValidationError):
        config(trigger="cost", migration="stall")


def test_cost_trigger_takes_the_candidate_that_pays_as_replay_does(store: Store) -> None:
    """With the incremental solver and no budget of its own, the cost trigger judges the move budgets, no budget
    and fresh greedy (`eplb.trigger.candidates`) and takes `eplb.trigger.choose_candidate`'s pick, the placement
    and copies of the candidate a replay would take from the same predictions."""
    from eplb.trigger import candidates, choose_candidate

    dep.register(store, "c", config(trigger="cost", steps=10**6))
    dep.process_window(store, "c", window(0))
    served = dep.current_placement(store, "c")
    assert served is not None
    moved = dep.process_window(store, "c", window(1))
    setup = dep.Setup(config(trigger="cost", steps=10**6))
    tried = candidates(LAYERS * 80)
    assert moved.action == "rebalanced" and f"of {len(tried)} candidates" in moved.reason
    loads = np.asarray(window(1), dtype=np.float64)
    before = evaluate(loads, served, setup.cost)
    assert before.prediction is not None
    h100 = HARDWARE_PRESETS["h100"]
    spec = MigrationSpec(h100.nvlink_bandwidth, hbm_bw=h100.hbm_bandwidth)  # the config's one link
    net, lbs, copies, outs = [], [], [], []
    for kwargs in tried:
        if kwargs.get("fresh"):
            out = solve(loads, setup.cluster, solver="greedy", cost=setup.cost, current=served, empty_slots=False)
        else:
            out = solve(loads, setup.cluster, solver="incremental", cost=setup.cost, current=served,
                        options=Options(max_moves=kwargs["max_moves"]), empty_slots=False)  # fmt: skip
        outs.append(out)
        judged = evaluate(loads, out.placement, setup.cost)
        assert judged.prediction is not None
        charge, _ = spec.rebalance_cost(out.placement.phy2log, served.phy2log, setup.cluster.slots_per_gpu,
                                        setup.model.expert_bytes, before.prediction).charge_s(
                                            before.prediction.total_time_us * 1e-6)  # fmt: skip
        net.append((before.prediction.total_time_us - judged.prediction.total_time_us) * 1e-6 * 10**6 - charge)
        lbs.append(float(judged.balance.lb.mean()))
        copies.append(int(count_moves(out.placement.phy2log, served.phy2log, setup.cluster.slots_per_gpu).sum()))
    pick = choose_candidate(net, lbs, copies)
    assert pick is not None and moved.entry.moves == copies[pick] and moved.result is not None
    assert moved.result.placement.phy2log == outs[pick].placement.phy2log.tolist()
    assert moved.result.moves is not None and moved.result.moves.total == copies[pick]


def test_a_deployment_over_two_links_predicts_with_the_nic_between_its_nodes(store: Store) -> None:
    two = {"link": "nvlink+nic", "cluster": dep.ClusterShape(num_gpus=8, slots_per_gpu=10, gpus_per_node=4),
           "tokens_per_gpu": 256.0}  # fmt: skip
    one = {**two, "link": "nic"}  # every copy over the NIC, one per pick
    dep.register(store, "two", config(trigger="periodic").model_copy(update=two))
    dep.register(store, "one", config(trigger="periodic").model_copy(update=one))
    times = {}
    for name in ("two", "one"):
        dep.process_window(store, name, window(0))
        moved = dep.process_window(store, name, window(1))
        assert moved.action == "rebalanced" and moved.entry.time_before_us is not None
        times[name] = moved.entry.time_before_us
    assert times["two"] < times["one"]  # NVLink within a node, the NIC once per other node reached
    migration = dep.Setup(config().model_copy(update=two)).migration  # copies from the other node over the NIC
    h100 = HARDWARE_PRESETS["h100"]
    assert (migration.link_bw, migration.inter_node_bw, migration.gpus_per_node) == (
        h100.nvlink_bandwidth, h100.nic_bandwidth, 4)


def test_solve_on_the_sum_of_recent_windows(store: Store) -> None:
    dep.register(store, "r", config(trigger="periodic", every=1, windows=2))
    dep.process_window(store, "r", window(0))
    served = dep.current_placement(store, "r")
    second = dep.process_window(store, "r", window(1))
    setup = dep.Setup(config())
    summed = np.asarray(window(0)) + np.asarray(window(1))
    expected = solve(summed, setup.cluster, solver=setup.solver_name(True), cost=setup.cost, current=served,
                     options=setup.options(True))
    assert second.entry.plan is not None and second.entry.plan == (expected.plan.to_dict() if expected.plan else None)
    assert second.result is not None
    assert second.result.placement.phy2log == expected.placement.phy2log.tolist()


def test_the_sum_of_recent_windows_skips_windows_of_other_layers(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """policy.windows 3 after a window of other layers: the last 2 stored windows of any shape were taken and the
    other shape dropped, so the solve summed 2 windows, not 3, though an older one of the window's shape was
    stored. It sums the last 2 of its shape, searched among the newest RECENT_WINDOWS_SCANNED stored windows."""
    dep.register(store, "mixed", config(trigger="periodic", every=1, windows=3))
    dep.process_window(store, "mixed", window(0))
    second = dep.process_window(store, "mixed", window(1))
    assert second.result is not None
    serving = second.result.placement.model_dump(exclude_none=True)
    part = {"phy2log": serving["phy2log"][:2], "slots_per_gpu": serving["slots_per_gpu"]}  # 2 of the 4 layers
    assert dep.process_window(store, "mixed", window(2)[:2], current_placement=part).action == "rebalanced"
    with store.read() as session:
        assert [w.tolist() for w in dep._recent_windows(session, "mixed", 2, (LAYERS, EXPERTS))] == [window(1),
                                                                                                      window(0)]
        monkeypatch.setattr(dep, "RECENT_WINDOWS_SCANNED", 2)  # the two newest: the 2-layer window and window(1)
        assert [w.tolist() for w in dep._recent_windows(session, "mixed", 2, (LAYERS, EXPERTS))] == [window(1)]
    monkeypatch.undo()
    last = dep.process_window(store, "mixed", window(3), current_placement=serving)
    setup = dep.Setup(config())
    served = Placement.from_dict({**serving, "num_experts": EXPERTS})

    def solved(*phases: int) -> list[list[int]]:
        summed = np.sum([window(p) for p in phases], axis=0)
        outcome = solve(summed, setup.cluster, solver=setup.solver_name(True), cost=setup.cost, current=served,
                        options=setup.options(True), empty_slots=False)
        phy2log: list[list[int]] = outcome.placement.phy2log.tolist()
        return phy2log

    assert last.result is not None and last.result.placement.phy2log == solved(3, 1, 0)
    assert solved(3, 1, 0) != solved(3, 1)  # what it summed before: the test tells the two apart


def test_history_pages_newest_first(store: Store) -> None:
    dep.register(store, "h", config(trigger="periodic", every=1))
    for i in range(5):
        dep.process_window(store, "h", window(i))
    page = dep.history(store, "h", limit=2)
    assert [e.seq for e in page.entries] == [5, 4] and page.next is not None
    page2 = dep.history(store, "h", limit=2, before=page.next)
    assert [e.seq for e in page2.entries] == [3, 2]
    last = dep.history(store, "h", limit=2, before=page2.next)
    assert [e.seq for e in last.entries] == [1] and last.next is None
    entry = page.entries[0]
    assert entry.window is not None and (entry.window.layers, entry.window.experts) == (LAYERS, EXPERTS)
    assert entry.window.tokens == pytest.approx(float(np.sum(window(4))))
    assert len(entry.window.digest) == 64 and entry.solver in registry.names()
    assert entry.solver_status is not None and entry.wall_ms is not None
    stored = dep.window_loads(store, entry.id)
    assert stored.tolist() == window(4)


def test_applied_placement_becomes_current(store: Store) -> None:
    dep.register(store, "a", config(trigger="periodic", every=1))
    first = dep.process_window(store, "a", window(0))
    second = dep.process_window(store, "a", window(1))
    assert first.result is not None and second.result is not None
    refused = first.result.placement.model_dump(exclude_none=True)  # the cluster kept the old placement
    entry = dep.record_applied(store, "a", refused)
    assert entry.action == "applied" and entry.moves == second.entry.moves  # back to where it was
    assert entry.lb_after == pytest.approx(second.entry.lb_before, abs=1e-6)  # judged on the last window
    assert dep.get(store, "a").placement == first.result.placement
    assert dep.history(store, "a", limit=1).entries[0].action == "applied"
    with pytest.raises(EplbError, match="8 GPUs, 8 slots each, the deployment has 8 GPUs, 10 slots each"):
        dep.record_applied(store, "a", {"phy2log": [list(range(64))] * LAYERS, "slots_per_gpu": [8] * 8})


def test_applying_the_placement_that_serves_records_nothing(client: TestClient, store: Store) -> None:
    """The placement already serving, reported applied (the plan of the last rebalance confirmed, every EP rank
    reporting it, a report sent twice), added an `applied` entry each time (0 moves, lb before = after), where the
    same map sent as a window's current_placement records none. Now nothing is recorded and the answer is the entry
    that made it serve; another placement is recorded as before, and the last window stays a duplicate."""
    dep.register(store, "confirm", config(trigger="periodic", every=1))
    first = dep.process_window(store, "confirm", window(0))
    assert first.result is not None and first.history_id is not None
    placed = first.result.placement.model_dump(exclude_none=True)
    for _ in range(2):
        confirmed = dep.record_applied(store, "confirm", placed)
        assert (confirmed.id, confirmed.action) == (first.history_id, "placed"), confirmed
    assert dep.history_count(store, "confirm") == 1
    second = dep.process_window(store, "confirm", window(1))
    assert second.action == "rebalanced" and second.result is not None
    over_http = client.post("/deployments/confirm/placement", json={"placement": second.result.placement.model_dump(
        mode="json", exclude_none=True)})
    assert over_http.status_code == 200 and over_http.json() == second.entry.model_dump(mode="json",
                                                                                         exclude_none=True)
    assert dep.process_window(store, "confirm", window(1)) == second  # still the last window, answered once
    refused = dep.record_applied(store, "confirm", placed)  # the cluster went back: recorded
    assert refused.action == "applied" and refused.moves == second.entry.moves
    assert dep.record_applied(store, "confirm", placed) == refused
    assert [e.action for e in dep.history(store, "confirm").entries] == ["applied", "rebalanced", "placed"]


def test_layer_ids_out_of_order_name_the_field_in_the_library_too(store: Store) -> None:
    """record_applied and a window's current_placement with layer_ids [4, 3, 2, 1] raised FieldError('placement')
    or ('current_placement'), not the field in it (the service's schema names it before, the library did not)."""
    dep.register(store, "shuffled", config())
    first = dep.process_window(store, "shuffled", window(0))
    assert first.result is not None
    shuffled = {**first.result.placement.model_dump(exclude_none=True), "layer_ids": [4, 3, 2, 1]}
    with pytest.raises(FieldError, match="layer 3 comes after layer 4") as applied:
        dep.record_applied(store, "shuffled", shuffled)
    with pytest.raises(FieldError, match="layer 3 comes after layer 4") as sent:
        dep.process_window(store, "shuffled", window(1), current_placement=shuffled)
    assert (applied.value.fields, sent.value.fields) == (("placement.layer_ids",), ("current_placement.layer_ids",))
    assert dep.history_count(store, "shuffled") == 1


def _concurrently(count: int, send: Any) -> list[Any]:
    """`send(i)` for i < count, each in its thread, released together; their answers in order of i."""
    results: list[Any] = [None] * count
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = send(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_windows_are_judged_one_after_the_other(store: Store) -> None:
    """Two threads send two moved windows (the same hot experts) at once: the lock makes the second see the first's
    placement."""
    dep.register(store, "c", config(trigger="threshold", threshold=1.10))
    dep.process_window(store, "c", window(0))
    results = _concurrently(2, lambda i: dep.process_window(store, "c", window(1, seed=i)))
    assert sorted(r.action for r in results) == ["kept", "rebalanced"]
    assert sorted(r.seq for r in results) == [2, 3]
    assert dep.get(store, "c").windows == 3


def test_first_puts_of_one_name_on_two_replicas_at_once_create_it_once(postgres: PostgresCluster) -> None:
    """Two PUTs of a new deployment at once on PostgreSQL (two replicas on one database): SELECT ... FOR UPDATE
    locked nothing, there being no row yet, so both inserted, and the second's IntegrityError was a 500. Now one
    creates it (201) and the other updates it (200). A SHARE lock on the table, held until both PUTs wait on it
    with their inserts, makes them overlap every time."""
    from sqlalchemy import text

    store = open_store(postgres.new_database())
    waiting = text("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'deployments'::regclass AND "
                   "database = (SELECT oid FROM pg_database WHERE datname = current_database())")
    body = config().model_dump(mode="json", exclude_none=True)
    answers: list[Any] = [None, None]
    try:
        with _service(store, raise_server_exceptions=False) as client, store.engine.connect() as hold:
            hold.execute(text("LOCK TABLE deployments IN SHARE MODE"))  # until the rollback below

            def put(i: int) -> None:
                answers[i] = client.put("/deployments/new", json=body)

            threads = [threading.Thread(target=put, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while hold.execute(waiting).scalar_one() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            reached = hold.execute(waiting).scalar_one()
            hold.rollback()  # both inserts go ahead together
            for t in threads:
                t.join()
        assert reached == 2, f"{reached} PUTs waited on the table lock"
        got = sorted((a.status_code, a.json().get("created") if a.is_success else a.text[:300]) for a in answers)
        assert got == [(200, False), (201, True)], got
        assert [v.name for v in dep.list_all(store)] == ["new"] and dep.history_count(store, "new") == 0
    finally:
        store.close()


def test_puts_racing_deletes_register_it_again_and_never_answer_422(client: TestClient, store: Store) -> None:
    """10 PUTs and 10 DELETEs of one deployment at once, a few rounds: a PUT that comes after a DELETE registers the
    deployment anew (201), one before it updates it (200); a DELETE answers 204, or 404 once it is gone. No 422 or
    500 for a valid body."""
    body = config().model_dump(mode="json", exclude_none=True)
    got: set[tuple[str, int]] = set()
    for _ in range(3):
        assert client.put("/deployments/raced", json=body).status_code in (200, 201)
        answers = _concurrently(20, lambda i: ("PUT", client.put("/deployments/raced", json=body)) if i % 2
                                else ("DELETE", client.delete("/deployments/raced")))
        got |= {(method, a.status_code) for method, a in answers}
    assert got <= {("PUT", 200), ("PUT", 201), ("DELETE", 204), ("DELETE", 404)}, got


def test_a_put_whose_row_a_delete_keeps_removing_is_a_409_not_a_422(client: TestClient, store: Store) -> None:
    """A PUT inserts the deployment again when a concurrent DELETE removed it before the PUT locked it; after
    `_CREATE_ATTEMPTS` such losses in a row it gave up with a 422 (an invalid body, it said, of a valid one). It is a
    409 Conflict. A trigger of the database that drops every insert of the name stands for the DELETEs."""
    from sqlalchemy import text

    with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            conn.execute(text("CREATE FUNCTION vanish() RETURNS trigger AS $$ BEGIN RETURN NULL; END $$ "
                              "LANGUAGE plpgsql"))
            conn.execute(text("CREATE TRIGGER vanish BEFORE INSERT ON deployments FOR EACH ROW "
                              "WHEN (NEW.name = 'ghost') EXECUTE FUNCTION vanish()"))
        else:
            conn.execute(text("CREATE TRIGGER vanish BEFORE INSERT ON deployments WHEN NEW.name = 'ghost' "
                              "BEGIN SELECT RAISE(IGNORE); END"))
    answer = client.put("/deployments/ghost", json=config().model_dump(mode="json", exclude_none=True))
    assert answer.status_code == 409, answer.text
    problem = answer.json()
    assert problem["title"] == "Conflict" and problem["detail"] == (
        "deployment 'ghost' was deleted 10 times while it was being registered (concurrent DELETE and PUT): send "
        "the PUT again")
    assert client.put("/deployments/other", json=config().model_dump(mode="json")).status_code == 201


def test_placement_dropped_says_what_this_put_dropped(client: TestClient, store: Store,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """PUT read the deployment before taking its lock: another request's PUT that dropped the serving placement
    between that read and this PUT's update made this PUT answer that it dropped it. The answer is now what the
    locked transaction saw: the other PUT's answer says it dropped it, this one does not."""
    dep.register(store, "raced", config())
    dep.process_window(store, "raced", window(0))
    bigger = config().model_copy(update={"cluster": dep.ClusterShape(num_gpus=8, slots_per_gpu=9)})
    register, other = dep.register, []

    def another_put_first(*args: Any) -> Any:  # another replica's PUT lands just before this one's
        other.append(register(store, "raced", bigger))
        return register(*args)

    monkeypatch.setattr(dep, "register", another_put_first)
    answer = client.put("/deployments/raced", json=bigger.model_dump(mode="json", exclude_none=True))
    assert answer.status_code == 200 and "placement_dropped" not in answer.json(), answer.json()
    assert other[0][0].placement_dropped == dep.PLACEMENT_DROPPED and other[0][0].placement is None


def test_every_rank_sending_one_window_gets_one_answer(store: Store) -> None:
    """Four threads (an engine's EP ranks) send the same window with the same serving placement at once: one is
    processed (the placement recorded, one rebalance), the others get its answer unchanged and store nothing."""
    dep.register(store, "ranks", config(trigger="threshold", threshold=1.10))
    first = dep.process_window(store, "ranks", window(0))
    assert first.result is not None
    serving = first.result.placement.model_copy(update={"phy2log": np.roll(first.result.placement.phy2log, 10,
                                                                            axis=1).tolist()}).model_dump()
    count = dep.history_count(store, "ranks")
    answers = _concurrently(4, lambda i: dep.process_window(store, "ranks", window(1), current_placement=serving))
    assert answers[0].action == "rebalanced" and all(a == answers[0] for a in answers)
    assert dep.get(store, "ranks").windows == 2
    entries = dep.history(store, "ranks").entries
    assert len(entries) == count + 2 and [e.action for e in entries[:2]] == ["rebalanced", "applied"]
    assert entries[0].lb_before == pytest.approx(evaluate(
        np.asarray(window(1)), Placement.from_dict(serving), dep.Setup(config()).cost).balance.lb.mean(), abs=1e-6)


def test_a_duplicate_is_the_last_window_sent_again_with_nothing_changed(store: Store) -> None:
    """The same window (loads, current placement, force, summary) again while the deployment is as it left it: the
    stored answer, to the last field, nothing stored. Anything else is a new window: other loads, another serving
    placement sent, force; the same content after another window, an applied placement or a config change."""
    dep.register(store, "dup", config(trigger="periodic", every=2))
    placed = dep.process_window(store, "dup", window(0))
    assert placed.window_key is not None and len(placed.window_key) == 64
    assert dep.process_window(store, "dup", window(0)) == placed  # 'placed' again, not 'kept' at window 2
    assert dep.get(store, "dup").windows == 1 and dep.history_count(store, "dup") == 1
    assert placed.result is not None
    serving = placed.result.placement.model_dump()
    same = dep.process_window(store, "dup", window(0), current_placement=serving)  # another request: a new window
    assert (same.action, same.seq) == ("kept", 2) and same.window_key != placed.window_key
    assert dep.history_count(store, "dup") == 2  # the placement sent is the one held: nothing applied
    assert dep.process_window(store, "dup", window(0), current_placement=serving) == same
    forced = dep.process_window(store, "dup", window(0), force=True, current_placement=serving)
    assert (forced.action, forced.seq) == ("rebalanced", 3)
    # the first window's content again, after other windows: a new window
    assert dep.process_window(store, "dup", window(0)).seq == 4
    # after an applied placement that changes what serves, the same content is a new window too
    again = dep.process_window(store, "dup", window(1))
    dep.record_applied(store, "dup", serving)
    assert dep.process_window(store, "dup", window(1)).seq == again.seq + 1
    # and after a config change (the same slots: the placement stays)
    last = dep.process_window(store, "dup", window(2))
    dep.register(store, "dup", config(trigger="periodic", every=3))
    assert dep.process_window(store, "dup", window(2)).seq == last.seq + 1


def test_a_current_placement_is_checked_against_the_deployment(store: Store) -> None:
    """A window's current_placement of another cluster, model or layer count, or with an empty slot, is refused
    naming the field, and nothing is stored."""
    dep.register(store, "cur", config())
    placed = dep.process_window(store, "cur", window(0))
    assert placed.result is not None
    good = placed.result.placement.model_dump()
    for bad, message in (
        ({**good, "slots_per_gpu": [8] * 10, "num_gpus": 10}, "current_placement: 10 GPUs, 8 slots each, the "
         "deployment has 8 GPUs, 10 slots each"),
        ({"phy2log": [list(range(32)) * 2 + list(range(16))] * LAYERS, "slots_per_gpu": [10] * 8, "num_experts": 32},
         "current_placement: 32 experts, the model has 64"),
        ({**good, "phy2log": good["phy2log"][:2], "replicas": good["replicas"][:2]},
         "current_placement: 2 layers, the window has 4"),
        ({"phy2log": [[-1, *row[1:]] for row in good["phy2log"]], "slots_per_gpu": good["slots_per_gpu"]},
         "current_placement.phy2log[0][0] is -1, an empty slot"),
        ({"phy2log": good["phy2log"]}, "current_placement: missing field 'slots_per_gpu'"),
    ):
        with pytest.raises(FieldError, match=f"^{re.escape(message)}") as refused:
            dep.process_window(store, "cur", window(1), current_placement=bad)
        assert refused.value.fields[0].startswith("current_placement")
    assert dep.get(store, "cur").windows == 1 and dep.history_count(store, "cur") == 1


def test_a_current_placement_replaces_a_stored_one_of_other_layers(store: Store) -> None:
    """A deployment serving 4 layers whose engine now sends 3 (another part of the model) refused every window, the
    serving map sent with it too ('loads: 3 layers, but the serving placement has 4'): the stored layer count was
    checked before current_placement could replace it. Now what serves is recorded first and the window judged on it;
    without current_placement the 422 says how to recover."""
    dep.register(store, "parts", config(trigger="periodic", every=1))
    assert dep.process_window(store, "parts", window(0)).action == "placed"
    three = window(1)[:3]
    with pytest.raises(FieldError, match=r"^loads: 3 layers, but the serving placement has 4 \(send the placement "
                       r"the cluster serves with the window, as current_placement\)$"):
        dep.process_window(store, "parts", three)
    serving = solve(np.asarray(window(2)[:3]), dep.Setup(config()).cluster, solver="greedy").placement
    answer = dep.process_window(store, "parts", three, current_placement=serving.to_dict())
    applied, judged = dep.history(store, "parts", limit=2).entries[::-1]
    assert (applied.action, applied.reason) == ("applied", "sent with the window as current_placement")
    assert applied.moves is None and applied.lb_before is None  # no copies from a placement of other layers
    lb = evaluate(np.asarray(three, dtype=np.float64), serving).balance.lb_over_tokens()
    assert judged.id == answer.history_id and answer.action == "rebalanced" and lb is not None
    assert answer.entry.lb_before == pytest.approx(lb[0], abs=1e-6)
    assert answer.result is not None and len(answer.result.placement.phy2log) == 3
    view = dep.get(store, "parts")
    assert view.placement is not None and view.placement.phy2log == answer.result.placement.phy2log


@pytest.mark.parametrize("change, message", [
    ({"model": "gpt-9"}, "model: unknown preset 'gpt-9'"),
    ({"hardware": "tpu"}, "hardware: unknown preset 'tpu'"),
    ({"solver": "simplex"}, "unknown solver 'simplex'"),
    ({"solver": "greedy", "policy": {"max_moves": 10}}, "solver 'greedy' does not take policy.max_moves: choose"),
    ({"solver": "greedy", "time_limit_s": 5}, "^solver 'greedy' does not take time_limit_s: "
     "choose a solver that does"),
    ({"cluster": {"num_gpus": 8, "slots_per_gpu": 7}}, "cannot hold|fewer than"),
    ({"link": "nvlink+nic"}, "^link, cluster.gpus_per_node: .*GPUs per node"),
    ({"cluster": {"num_gpus": 8, "slots_per_gpu": 10, "gpus_per_node": 3}},
     "^cluster.gpus_per_node: 8 GPUs do not split into nodes of 3$"),
    ({"cluster": {"num_gpus": 8, "slots_per_gpu": 10, "gpus_per_node": 3}, "link": "nvlink+nic"},
     "^cluster.gpus_per_node: 8 GPUs do not split into nodes of 3$"),
    ({"cluster": {"num_gpus": 8, "slots_per_gpu": 10, "gpus_per_node": 4, "num_groups": 3}},
     "^cluster.num_groups: 64 experts do not split into 3 equal groups$"),
    ({"solver": "deepseek", "cluster": {"num_gpus": 2, "slots_per_gpu": [32, 40]}},
     "solver 'deepseek' needs the same slot count on every GPU"),
    ({"solver": "greedy-coact", "cluster": {"num_gpus": 8, "slots_per_gpu": 10, "gpus_per_node": 4, "num_groups": 8}},
     "^solver, cluster.gpus_per_node, cluster.num_groups: solver 'greedy-coact' does not keep expert groups within "
     "nodes"),
    ({"solver": "milp", "cluster": {"num_gpus": 8, "slots_per_gpu": 10, "gpus_per_node": 4, "num_groups": 8}},
     "^solver, cluster.gpus_per_node, cluster.num_groups: every rebalance starts from the serving placement, and "
     "solver 'milp' keeps expert groups within nodes or minimizes copies from a current placement, not both"
     r": drop cluster.num_groups/cluster.gpus_per_node, or choose a solver that does both \(incremental\)$"),
])
def test_bad_configs_are_one_line_errors(store: Store, change: dict[str, Any], message: str) -> None:
    body = {**config().model_dump(mode="json", exclude_none=True), **change}
    with pytest.raises(EplbError, match=message):
        dep.register(store, "bad", dep.DeploymentConfig.model_validate(body))


def test_bad_windows_and_names(store: Store) -> None:
    dep.register(store, "w", config())
    with pytest.raises(EplbError, match="the window has 3 experts, but model 'deepseek-v2-lite' has 64: send one row"):
        dep.process_window(store, "w", [[1, 2, 3]])
    with pytest.raises(EplbError, match=r"loads\[0\]\[0\] is -1: loads must be >= 0"):
        dep.process_window(store, "w", [[-1.0] * EXPERTS])
    with pytest.raises(dep.NotFound):
        dep.process_window(store, "nobody", window(0))
    with pytest.raises(EplbError, match="deployment name"):
        dep.register(store, "no/slash", config())


# ----- over HTTP, in process ---------------------------------------------------------------------------------
@contextmanager
def _service(store: Store, raise_server_exceptions: bool = True) -> Iterator[TestClient]:
    """The service in process on `store`, its API key sent."""
    from api.app import create_app
    from api.database import SqlJobStore
    from api.settings import Settings

    settings = Settings(solver_workers=1, api_key="k")
    app = create_app(settings, job_store=SqlJobStore(store, settings.max_jobs, settings.job_ttl_s))
    app.state.db = store
    with TestClient(app, headers={"Authorization": "Bearer k"}, raise_server_exceptions=raise_server_exceptions) as c:
        yield c


@pytest.fixture
def client(store: Store) -> Iterator[TestClient]:
    with _service(store) as c:
        yield c


def test_http_walkthrough(client: TestClient) -> None:
    body = config(threshold=1.1).model_dump(mode="json", exclude_none=True)
    assert client.put("/deployments/web", json=body).status_code == 201
    assert client.put("/deployments/web", json=body).status_code == 200
    placed = client.post("/deployments/web/windows", json={"loads": window(0)}).json()
    assert placed["action"] == "placed" and placed["result"]["placement"]["num_gpus"] == 8
    kept = client.post("/deployments/web/windows", json={"loads": window(0, seed=3)}).json()
    assert kept["action"] == "kept" and "result" not in kept
    moved = client.post("/deployments/web/windows", json={"loads": window(1)}).json()
    assert moved["action"] == "rebalanced" and moved["result"]["moves"]["total"] == moved["entry"]["moves"] > 0
    page = client.get("/deployments/web/history", params={"limit": 2}).json()
    assert [e["action"] for e in page["entries"]] == ["rebalanced", "kept"] and page["next"]
    applied = client.post("/deployments/web/placement", json={"placement": placed["result"]["placement"]})
    assert applied.status_code == 200 and applied.json()["action"] == "applied"
    got = client.get("/deployments/web").json()
    assert got["placement"]["phy2log"] == placed["result"]["placement"]["phy2log"] and got["windows"] == 3
    sglang = client.get("/deployments/web", params={"format": "sglang"}).json()
    assert sglang["physical_to_logical_map"] == placed["result"]["placement"]["phy2log"]
    assert [d["name"] for d in client.get("/deployments").json()["deployments"]] == ["web"]
    assert client.delete("/deployments/web").status_code == 204
    missing = client.get("/deployments/web")
    assert missing.status_code == 404 and missing.headers["content-type"].startswith("application/problem+json")
    assert "no deployment named 'web'" in missing.json()["detail"]

    # errors: problem details naming what to fix
    assert client.put("/deployments/x", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    typo = client.put("/deployments/x", json={**body, "policy": {"trigerr": "cost"}})
    assert typo.status_code == 422 and typo.json()["errors"][0]["field"] == "policy.trigerr"
    unknown = client.put("/deployments/x", json={**body, "model": "gpt-9"})
    assert unknown.status_code == 422 and "unknown preset 'gpt-9'" in unknown.json()["detail"]
    assert client.post("/deployments/x/windows", json={"loads": window(0)}).status_code == 404
    client.put("/deployments/x", json=body)
    assert client.get("/deployments/x", params={"format": "trtllm"}).status_code == 404  # no placement yet
    short = client.post("/deployments/x/windows", json={"loads": [[1.0, 2.0]]})
    assert short.status_code == 422 and "64" in short.json()["detail"]
    from eplb.coactivation import read_topk, summarize

    ids, _ = read_topk(Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz")
    summary = summarize(ids[:, :LAYERS], EXPERTS).to_dict()
    loads = np.asarray(summary["loads"], dtype=float).tolist()  # the window the summary is of
    with_pairs = client.post("/deployments/x/windows", json={"loads": loads, "coactivation": summary}).json()
    assert with_pairs["action"] == "placed" and len(with_pairs["result"]["predicted"]["copies_per_token"]["gpus"]) == 4
    bad = client.post("/deployments/x/windows", json={"loads": loads, "coactivation": {**summary, "top_k": "8"}})
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "coactivation.top_k"


def test_http_windows_with_the_serving_placement(client: TestClient) -> None:
    """current_placement in a window: recorded when the deployment holds another, then the window judged; the same
    request again gets the same body; one the deployment cannot hold is a 422 whose errors name it (what the
    plug-ins read as a deployment for another cluster)."""
    body = config(trigger="periodic").model_dump(mode="json", exclude_none=True)
    assert client.put("/deployments/serving", json=body).status_code == 201
    placed = client.post("/deployments/serving/windows", json={"loads": window(0)}).json()["result"]["placement"]
    rolled = {"phy2log": np.roll(placed["phy2log"], 10, axis=1).tolist(), "slots_per_gpu": placed["slots_per_gpu"]}
    request = {"loads": window(1), "current_placement": rolled}
    answers = [client.post("/deployments/serving/windows", json=request) for _ in range(2)]
    assert answers[0].status_code == 200 and answers[0].content == answers[1].content
    assert answers[0].json()["action"] == "rebalanced" and answers[0].json()["seq"] == 2
    history = client.get("/deployments/serving/history").json()["entries"]
    assert [e["action"] for e in history] == ["rebalanced", "applied", "placed"]
    assert history[1]["reason"] == "sent with the window as current_placement"
    other = {"phy2log": [list(range(EXPERTS))] * LAYERS, "slots_per_gpu": [8] * 8}  # a cluster of 8 x 8 slots
    refused = client.post("/deployments/serving/windows", json={"loads": window(2), "current_placement": other})
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "current_placement"
    assert refused.json()["detail"] == ("current_placement: 8 GPUs, 8 slots each, the deployment has 8 GPUs, "
                                        "10 slots each")
    assert client.get("/deployments/serving").json()["windows"] == 2



def test_cli_reads_the_database(store: Store, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eplb.cli import main

    dep.register(store, "cli", config(threshold=1.1))
    for phase, seed in ((0, 0), (0, 1), (1, 0)):  # placed, kept, rebalanced
        dep.process_window(store, "cli", window(phase, seed))
    assert main(["deployments", "list", "--database-url", db_url]) == 0
    assert "cli " in capsys.readouterr().out
    assert main(["deployments", "show", "cli", "--database-url", db_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["windows"] == 3
    assert main(["deployments", "history", "cli", "--database-url", db_url, "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "rebalanced" in out[1] and "kept" in out[2] and "--before" in out[3]
    png = tmp_path / "history.png"
    assert main(["history", "cli", "--database-url", db_url, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "3 events" in capsys.readouterr().out
    assert main(["deployments", "show", "gone", "--database-url", db_url]) == 2
    assert "no deployment named 'gone'" in capsys.readouterr().err


def test_windows_carry_coactivation_and_the_history_keeps_it(store: Store) -> None:
    from eplb.coactivation import read_topk, summarize
    from eplb.io.windows import read_window

    law = Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"
    ids, _ = read_topk(law)
    loads = read_window(law).loads
    summary = summarize(ids, EXPERTS)
    body = {"model": MODEL, "hardware": "h800", "link": "nic", "tokens_per_gpu": 256.0, "objective": "time",
            "cluster": {"num_gpus": 8, "slots_per_gpu": 9}}
    dep.register(store, "coact", dep.DeploymentConfig.model_validate(body))
    placed = dep.process_window(store, "coact", loads.tolist(), coactivation=summary.to_dict())
    assert placed.action == "placed" and placed.result is not None
    assert placed.result.solver is not None and placed.result.solver.model_dump()["objective"] == "time"
    copies = placed.result.predicted.copies_per_token
    assert copies is not None and len(copies.gpus) == loads.shape[0]
    kept = dep.window_coactivation(store, placed.history_id)
    assert kept is not None and kept.to_dict() == summary.to_dict()
    plain = dep.process_window(store, "coact", loads.tolist(), force=True)
    assert dep.window_coactivation(store, plain.history_id) is None
    # against the serving placement (incremental), co-located layers still keep staying experts in their slots
    again = dep.process_window(store, "coact", loads[::-1].tolist(), coactivation=summarize(ids[:, ::-1], EXPERTS)
                               .to_dict(), force=True)  # fmt: skip
    assert again.action == "rebalanced" and again.result is not None and again.result.solver is not None
    assert set(again.result.solver.model_dump()["layer_choice"]) != {"solver"}
    plan = again.result.plan
    assert isinstance(plan, dict) and again.result.moves is not None
    assert again.result.moves.total == sum(len(stage["copies"]) for stage in plan["stages"])
    with pytest.raises(EplbError, match="coactivation: the summary is for 2 layers"):
        dep.process_window(store, "coact", loads.tolist(), coactivation=summarize(ids[:, :2], EXPERTS).to_dict())
    with pytest.raises(EplbError, match=r"^coactivation: missing field"):
        dep.process_window(store, "coact", loads.tolist(), coactivation={"tokens": "many"})


def test_a_windows_summary_that_does_not_read_is_a_422_naming_coactivation(client: TestClient, store: Store) -> None:
    """A summary string that is no base64 of a .npz image, or an object missing a field the schema leaves to the
    parser, was a 422 with its message in `detail` only (POST /placement names `coactivation`); its form, the
    same summary as an object and as base64 of its image, is taken and kept either way."""
    import base64

    from eplb.coactivation import summarize

    assert client.put("/deployments/pairs", json=MIXTRAL).status_code == 201
    for value, message in (("not base64!", "a string must be base64 of its .npz image"),
                           (base64.b64encode(b"hello").decode(), "not a .npz image of one")):
        answer = client.post("/deployments/pairs/windows", json={"loads": MIXTRAL_LOADS, "coactivation": value})
        assert answer.status_code == 422, answer.text
        problem = answer.json()
        assert [e["field"] for e in problem["errors"]] == ["coactivation"], problem
        assert problem["errors"][0]["message"].startswith(message), problem
        assert problem["detail"].startswith(f"coactivation: {message}"), problem
    ids = np.array([[[0, 1], [0, 5]], [[2, 3], [3, 6]]])  # 2 tokens x 2 layers, top-2 of the 8 experts
    summary = summarize(ids, 8)
    loads = summary.loads.astype(float).tolist()
    forms: list[Any] = [summary.to_dict(), base64.b64encode(summary.to_bytes()).decode()]
    for value in forms:
        placed = client.post("/deployments/pairs/windows", json={"loads": loads, "coactivation": value, "force": True})
        assert placed.status_code == 200, placed.text
        assert "copies_per_token" in placed.json()["result"]["predicted"]
        kept = dep.window_coactivation(store, placed.json()["history_id"])
        assert kept is not None and kept.to_dict() == summary.to_dict()


def test_time_objective_deployment_never_serves_empty_slots(store: Store) -> None:
    body = {"model": MODEL, "hardware": "h800", "tokens_per_gpu": 256.0, "objective": "time",
            "cluster": {"num_gpus": 8, "slots_per_gpu": 9}}  # NVLink decode: weight reads bound the layers
    from eplb.io.windows import read_window
    from eplb.solve import Cluster, solve

    loads = read_window(Path(__file__).resolve().parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz").loads
    setup = dep.Setup(dep.DeploymentConfig.model_validate(body))
    stateless = solve(loads, Cluster(np.full(8, 9, dtype=np.int64)), cost=setup.cost, objective="time")
    assert stateless.placement.empty_slots.any()  # what a one-off solve picks for these layers
    dep.register(store, "decode", dep.DeploymentConfig.model_validate(body))
    first = dep.process_window(store, "decode", loads.tolist())
    second = dep.process_window(store, "decode", (loads[::-1] + 0).tolist(), force=True)  # first is now current
    assert first.action == "placed" and second.action == "rebalanced"
    for result in (first.result, second.result):
        assert result is not None and min(min(row) for row in result.placement.phy2log) >= 0


def _edit_stored_config(store: Store, name: str, edit: Any) -> None:
    """Rewrite a stored config as an older version of eplb would have stored it."""
    import eplb.store.models as models

    with store.write() as session:
        row = session.get(models.DeploymentRow, name)
        assert row is not None
        row.config = edit(dict(row.config))


def test_the_default_slot_budget_is_stored_explicitly(store: Store) -> None:
    cfg = config().model_copy(update={"cluster": dep.ClusterShape(num_gpus=8)})  # no slot field: the default
    view, _ = dep.register(store, "d", cfg)
    assert view.config.cluster.num_redundant == 8  # one redundant per GPU, written out


def test_rows_stored_under_an_older_default_or_older_checks_still_read(store: Store) -> None:
    # more GPUs than experts: the old default gave E + G slots; a row stored then has no slot field
    wide = config().model_copy(update={"cluster": dep.ClusterShape(num_gpus=80, num_redundant=80)})
    dep.register(store, "old-default", wide)
    dep.process_window(store, "old-default", window(0), force=True)
    assert dep.current_placement(store, "old-default") is not None

    def no_slots(c: dict[str, Any]) -> dict[str, Any]:
        return {**c, "cluster": {k: v for k, v in c["cluster"].items() if k != "num_redundant"}}

    _edit_stored_config(store, "old-default", no_slots)
    assert dep.get(store, "old-default").placement is None  # 144 stored slots, 80 now: placed afresh next
    assert dep.process_window(store, "old-default", window(0)).action == "placed"
    assert dep.current_placement(store, "old-default") is not None
    # a node limit without nodes, accepted before the check existed
    dep.register(store, "old-check", config())
    dep.process_window(store, "old-check", window(0), force=True)
    _edit_stored_config(store, "old-check", lambda c: {**c, "node_limit": 4})
    assert [v.name for v in dep.list_all(store)] == ["old-check", "old-default"]
    assert dep.get(store, "old-check").placement is not None
    with pytest.raises(EplbError, match=r"node_limit, cluster\.gpus_per_node: a node limit caps the nodes"):
        dep.process_window(store, "old-check", window(1))
    assert dep.register(store, "old-check", config())[0].placement is not None  # fixed by a PUT


def test_a_stored_config_this_version_cannot_resolve_still_reads_and_a_put_fixes_it(store: Store) -> None:
    dep.register(store, "renamed", config())
    dep.process_window(store, "renamed", window(0), force=True)
    _edit_stored_config(store, "renamed", lambda c: {**c, "model": "a-preset-since-renamed"})
    assert dep.get(store, "renamed").placement is None  # nothing serves that this version can read
    assert [v.name for v in dep.list_all(store)] == ["renamed"]
    view, created = dep.register(store, "renamed", config())
    assert not created and view.config.model == MODEL


MIXTRAL = {"model": "mixtral-8x7b", "hardware": "h100", "cluster": {"num_gpus": 4, "num_redundant": 4}}
MIXTRAL_LOADS = [[120.0, 80, 5, 3, 60, 40, 33, 11], [40.0, 40, 60, 70, 10, 90, 5, 5]]
WITH_EMPTY_SLOT = {"slots_per_gpu": [3, 3, 3, 3], "phy2log": [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, -1]] * 2}


def test_an_applied_placement_with_an_empty_slot_is_refused_by_name(client: TestClient) -> None:
    """Windows refuse a serving placement with empty slots: /placement refuses it first, serving or not (it was
    a 500 from the move count with a placement serving, and accepted, then every window's 422, without one)."""
    for serving in (True, False):
        name = f"mix-{serving}"
        assert client.put(f"/deployments/{name}", json=MIXTRAL).status_code == 201
        if serving:
            assert client.post(f"/deployments/{name}/windows", json={"loads": MIXTRAL_LOADS}).status_code == 200
        before = client.get(f"/deployments/{name}").json().get("placement")
        refused = client.post(f"/deployments/{name}/placement", json={"placement": WITH_EMPTY_SLOT})
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"].startswith("placement.phy2log[0][11] is -1, an empty slot")
        assert client.get(f"/deployments/{name}").json().get("placement") == before  # nothing recorded
        assert client.post(f"/deployments/{name}/windows", json={"loads": MIXTRAL_LOADS}).status_code == 200
        assert client.get(f"/deployments/{name}", params={"format": "sglang"}).status_code == 200


def test_a_stored_placement_with_empty_slots_serves_nothing(store: Store) -> None:
    """One recorded before /placement refused them: the next window places afresh instead of failing forever."""
    from eplb.store.arrays import pack

    dep.register(store, "holes", dep.DeploymentConfig.model_validate(MIXTRAL))
    dep.process_window(store, "holes", MIXTRAL_LOADS)
    with store.write() as session:
        row = session.get(DeploymentRow, "holes")
        assert row is not None
        row.phy2log = pack(np.asarray(WITH_EMPTY_SLOT["phy2log"], dtype=np.int64))
    assert dep.get(store, "holes").placement is None
    assert dep.process_window(store, "holes", MIXTRAL_LOADS).action == "placed"
    placed = dep.get(store, "holes").placement
    assert placed is not None and dep.record_applied(store, "holes", placed.model_dump()).moves == 0


def test_more_layers_than_the_model_has_are_refused_by_one_rule(client: TestClient, store: Store) -> None:
    """A DeepSeek-V3 deployment took a 2000 x 256 window and exported 2000 SGLang rows, TensorRT-LLM keys and
    vllm-ascend MoE layers of a 61-layer model; POST /placement took 100 layers for the named model. One rule now
    (`ModelSpec.window_mismatch`): at most the model's MoE layers (fewer are a part of it), a 422 naming loads and
    the count, nothing stored. An applied placement and a window's current_placement are held to it too, a
    placement stored before serves nothing, and a window of more layers infers no preset for its times."""
    loads = np.random.default_rng(0).integers(0, 100, (59, 256)).astype(float).tolist()
    v3 = {"model": "deepseek-v3", "cluster": {"num_gpus": 32}}
    assert client.put("/deployments/huge", json=v3).status_code == 201
    window = client.post("/deployments/huge/windows", json={"loads": loads})
    placed = client.post("/placement", json={"model": "deepseek-v3", "loads": loads, "cluster": {"num_gpus": 32}})
    message = ("the window has 59 layers, but model 'deepseek-v3' has 58 MoE layers (61 layers, the first 3 dense): "
               "send one row per MoE layer, at most 58 (fewer are a part of the model), of its 256 experts")
    for answer in (window, placed):
        assert answer.status_code == 422 and answer.json()["errors"] == [{"field": "loads", "message": message}]
        assert answer.json()["detail"] == f"loads: {message}"
    assert client.get("/deployments/huge").json()["windows"] == 0
    assert client.get("/deployments/huge", params={"format": "sglang"}).status_code == 404  # nothing to export
    unnamed = client.post("/placement", json={"loads": loads, "cluster": {"num_gpus": 32}})
    assert unnamed.status_code == 200 and "time_us" not in unnamed.json()["predicted"]  # no preset has 59 x 256
    assert client.post("/placement", json={"loads": loads[:58], "cluster": {"num_gpus": 32}}).json()["predicted"][
        "time_us"]  # 58 layers: DeepSeek-V3's, inferred

    assert client.put("/deployments/mix", json=MIXTRAL).status_code == 201  # 32 MoE layers, no dense one
    rows = [MIXTRAL_LOADS[0]] * 33
    too_long = {"slots_per_gpu": [3] * 4, "phy2log": [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]] * 33}
    applied = client.post("/deployments/mix/placement", json={"placement": too_long})
    assert applied.status_code == 422 and applied.json()["errors"][0]["field"] == "placement"
    assert "33 layers, but model 'mixtral-8x7b' has 32 MoE layers (32 layers):" in applied.json()["detail"]
    sent = client.post("/deployments/mix/windows", json={"loads": rows, "current_placement": too_long})
    assert sent.status_code == 422 and [e["field"] for e in sent.json()["errors"]] == ["loads"]
    assert client.post("/deployments/mix/windows", json={"loads": rows[:32]}).json()["action"] == "placed"
    from eplb.store.arrays import pack

    with store.write() as session:  # a placement stored before the rule: it serves nothing, exports nothing
        row = session.get(DeploymentRow, "mix")
        assert row is not None
        row.phy2log = pack(np.asarray(too_long["phy2log"], dtype=np.int64))
    assert client.get("/deployments/mix").json().get("placement") is None
    assert client.get("/deployments/mix", params={"format": "trtllm"}).status_code == 404
    assert client.post("/deployments/mix/windows", json={"loads": rows[:32]}).json()["action"] == "placed"


def test_a_window_without_tokens_is_kept_and_a_layer_without_tokens_has_no_lb(store: Store) -> None:
    """An all-zero window was judged 'predicted lb 1.0000 <= 1.1' (kept), and a layer without tokens counted as lb
    1.0 in the trigger's mean: a window without tokens is kept whatever the trigger or force says, its reason saying
    so, no lb stored; the trigger's mean, and the history's, are over the layers with tokens (docs/replay.md)."""
    zero = np.zeros((LAYERS, EXPERTS)).tolist()
    dep.register(store, "empty", config(trigger="threshold", threshold=2.0))
    first = dep.process_window(store, "empty", zero)
    assert (first.action, first.result, first.entry.lb_before, first.entry.lb_after) == ("kept", None, None, None)
    assert first.reason == "the window has no tokens (no lb to judge): nothing to place on, no placement serves yet"
    assert dep.get(store, "empty").placement is None and dep.get(store, "empty").windows == 1
    assert dep.process_window(store, "empty", window(0)).action == "placed"
    for force in (False, True):
        kept = dep.process_window(store, "empty", zero, force=force)
        assert kept.action == "kept" and kept.entry.lb_before is None and kept.entry.moves == 0
        assert kept.reason == ("forced by the request, but " if force else "") + (
            "the window has no tokens (no lb to judge): the serving placement stays")
    serving = dep.current_placement(store, "empty")
    assert serving is not None
    moved = np.asarray(window(1))
    moved[:3] = 0.0  # one layer of the moved load left: lb 3.47 there; with three layers of 1.0 the mean was 1.62
    lb = evaluate(moved[3:], Placement(serving.phy2log[3:], serving.slots_per_gpu, EXPERTS), dep.Setup(config()).cost)
    judged = dep.process_window(store, "empty", moved.tolist())
    assert judged.action == "rebalanced" and judged.entry.lb_before == pytest.approx(float(lb.balance.lb[0]), abs=1e-6)
    assert judged.reason == f"threshold: predicted lb {float(lb.balance.lb[0]):.4f} > 2.0"
    assert judged.result is not None and judged.result.predicted.lb[:3] == [None] * 3
    assert judged.result.predicted.lb_mean == judged.entry.lb_after
    dep.register(store, "every", config(trigger="periodic", every=1))
    dep.process_window(store, "every", window(0))
    assert dep.process_window(store, "every", zero).action == "kept"


def test_post_placement_and_a_window_report_no_lb_for_layers_without_tokens(client: TestClient) -> None:
    """POST /placement answered lb 1.0 for an all-zero layer (lb_mean counted it): null there now, in lb,
    balancedness and imbalance, placement and baseline, lb_mean and lb_max over the layers with tokens and left out
    when none has any; the answer built straight from the outcome and the one through the models (a co-activation
    summary sends it there) agree, and so does a deployment's window."""
    from eplb.coactivation import summarize

    loads = [[0.0] * 8, MIXTRAL_LOADS[0]]
    for body in ({"loads": loads}, {"loads": [[0.0] * 8] * 2}):
        answer = client.post("/placement", json={**MIXTRAL, **body})
        assert answer.status_code == 200, answer.text
        predicted = answer.json()["predicted"]
        tokens = [any(row) for row in body["loads"]]
        for numbers in (predicted, predicted["baseline"]):
            for key in ("lb", "balancedness", "imbalance"):
                assert [v is not None for v in numbers[key]] == tokens, (key, numbers)
            assert ("lb_mean" in numbers) == ("lb_max" in numbers) == any(tokens)
        if any(tokens):
            assert predicted["lb_mean"] == predicted["lb_max"] == predicted["lb"][1] > 1.0
    summary = summarize(np.array([[[0, 1], [3, 4]], [[0, 5], [2, 6]]]), 8)  # 2 tokens x 2 layers, top-2
    paired = summary.loads.astype(float)
    paired[0] = 0.0  # a layer without tokens in both the window and its summary
    partners, counts = summary.partners.copy(), summary.counts.copy()
    partners[0], counts[0] = -1, 0
    zero_layer = {**summary.to_dict(), "tokens": [0, 2], "loads": [[0] * 8, summary.loads[1].tolist()],
                  "partners": partners.tolist(), "counts": counts.tolist()}
    through_models = client.post("/placement", json={**MIXTRAL, "loads": paired.tolist(), "coactivation": zero_layer})
    assert through_models.status_code == 200, through_models.text
    assert through_models.json()["predicted"]["lb"][0] is None and "copies_per_token" in through_models.json()[
        "predicted"]
    assert client.put("/deployments/zero", json=MIXTRAL).status_code == 201
    placed = client.post("/deployments/zero/windows", json={"loads": loads}).json()
    assert placed["action"] == "placed" and placed["result"]["predicted"]["lb"][0] is None
    assert placed["entry"]["lb_after"] == placed["result"]["predicted"]["lb_mean"]


GROUPS_NEED_NODES = ("needs cluster.gpus_per_node: the hierarchical policy keeps each group of experts within a "
                     "node; give both, or neither")


@pytest.mark.parametrize("shape, field, message", [
    ({"gpus_per_node": 3}, "cluster.gpus_per_node", "4 GPUs do not split into nodes of 3"),
    ({"gpus_per_node": 8}, "cluster.gpus_per_node", "4 GPUs do not split into nodes of 8"),
    ({"gpus_per_node": 2, "num_groups": 3}, "cluster.num_groups", "8 experts do not split into 3 equal groups"),
    ({"num_groups": 3}, "cluster.num_groups", GROUPS_NEED_NODES),  # no nodes: refused before the split is checked
    ({"num_groups": 2}, "cluster.num_groups", GROUPS_NEED_NODES),  # it was ignored
])
def test_a_cluster_shape_every_window_refuses_is_refused_at_put(
    client: TestClient, shape: dict[str, int], field: str, message: str
) -> None:
    """Nodes and groups the first window's solve would refuse (without naming the field): a 422 at PUT."""
    body = {**MIXTRAL, "cluster": {"num_gpus": 4, **shape}}
    answer = client.put("/deployments/shape", json=body)
    assert answer.status_code == 422 and answer.json()["detail"] == f"{field}: {message}"
    assert answer.json()["errors"] == [{"field": field, "message": message}]  # as every other 422
    assert client.get("/deployments/shape").status_code == 404


def test_groups_without_nodes_are_refused_by_the_cluster_shape_itself(store: Store, client: TestClient) -> None:
    """The rule lived in the HTTP layer only (twice): `eplb.deployments.register` took a config with num_groups and
    no gpus_per_node and every window ignored the groups. ClusterShape refuses it (as POST /placement's ClusterIn,
    one rule), naming cluster.num_groups; a gpus_per_node that fails its own bound is the one error shown."""
    from api.schemas import ClusterIn

    with pytest.raises(ValidationError) as refused:
        dep.register(store, "g", dep.DeploymentConfig.model_validate(
            {"model": "mixtral-8x7b", "cluster": {"num_gpus": 4, "num_groups": 2}}))
    assert [(e["loc"], e["msg"]) for e in refused.value.errors()] == [
        (("cluster", "num_groups"), f"Value error, {GROUPS_NEED_NODES}")]
    with pytest.raises(dep.NotFound):
        dep.get(store, "g")
    for shape in (dep.ClusterShape, ClusterIn):
        with pytest.raises(ValidationError) as bad_nodes:
            shape.model_validate({"num_gpus": 4, "gpus_per_node": 0, "num_groups": 2})
        assert [e["loc"] for e in bad_nodes.value.errors()] == [("gpus_per_node",)]
        assert shape.model_validate({"num_gpus": 4, "gpus_per_node": 2, "num_groups": 2}).num_groups == 2
    answer = client.post("/placement", json={"model": "mixtral-8x7b", "loads": MIXTRAL_LOADS,
                                             "cluster": {"num_gpus": 4, "num_groups": 2}})
    assert answer.json()["errors"] == [{"field": "cluster.num_groups", "message": GROUPS_NEED_NODES}], answer.text


HIERARCHICAL = {"num_gpus": 4, "num_redundant": 4, "gpus_per_node": 2, "num_groups": 2}  # 2 nodes of 2 GPUs


@pytest.mark.parametrize("solver", [None, "greedy", "deepseek", "milp", "milp-weighted"])
def test_put_refuses_a_hierarchical_cluster_every_rebalance_of_its_solver_would_refuse(
    client: TestClient, solver: str | None
) -> None:
    """The MILP keeps expert groups within nodes only without a serving placement, and every rebalance starts from
    one: it used to pass PUT and place the first window, then answer 422 to every window that rebalanced. PUT
    refuses it now, naming the fields; a solver that takes both is accepted, and its windows place and
    rebalance; the MILP without the groups is accepted too."""
    chosen: dict[str, Any] = {} if solver is None else {"solver": solver}
    if solver is not None and solver.startswith("milp"):
        chosen["time_limit_s"] = 2.0
    body = {**MIXTRAL, **chosen, "cluster": HIERARCHICAL, "policy": {"trigger": "periodic"}}
    answer = client.put("/deployments/nodes", json=body)
    flipped = [row[4:] + row[:4] for row in MIXTRAL_LOADS]  # the load moved to the other experts
    if solver in ("milp", "milp-weighted"):
        assert answer.status_code == 422, answer.text
        detail = answer.json()["detail"]
        assert detail.startswith("solver, cluster.gpus_per_node, cluster.num_groups: every rebalance starts from the "
                                 f"serving placement, and solver '{solver}' keeps expert groups within nodes or "
                                 "minimizes copies from a current placement, not both"), detail
        assert client.get("/deployments/nodes").status_code == 404
        for name, cluster in (("flat", {"num_gpus": 4, "num_redundant": 4}),
                              ("nodes-only", {"num_gpus": 4, "num_redundant": 4, "gpus_per_node": 2})):
            flat = {**body, "cluster": cluster}  # no groups (nodes alone are no hierarchical policy): accepted
            assert client.put(f"/deployments/{name}", json=flat).status_code == 201
            actions = [client.post(f"/deployments/{name}/windows", json={"loads": w}).json()["action"]
                       for w in (MIXTRAL_LOADS, flipped)]
            assert actions == ["placed", "rebalanced"]
        assert client.put("/deployments/flat", json=body).status_code == 422  # an update is refused alike
        assert "gpus_per_node" not in client.get("/deployments/flat").json()["config"]["cluster"]
        return
    assert answer.status_code == 201, answer.text
    placed = client.post("/deployments/nodes/windows", json={"loads": MIXTRAL_LOADS})
    moved = client.post("/deployments/nodes/windows", json={"loads": flipped})
    assert placed.status_code == moved.status_code == 200, moved.text
    assert (placed.json()["action"], moved.json()["action"]) == ("placed", "rebalanced")
    assert moved.json()["entry"]["solver"] == solver or (solver is None and moved.json()["entry"]["solver"] ==
                                                         "incremental")


def test_a_stored_milp_config_with_groups_names_the_fields_at_its_next_window(store: Store) -> None:
    """A config stored before PUT refused it: its next window is refused by the same check, naming the fields,
    instead of placing once and refusing every rebalance from then on; a PUT fixes it."""
    shape = dep.ClusterShape(num_gpus=8, slots_per_gpu=10, gpus_per_node=4, num_groups=8)
    dep.register(store, "old-milp", config().model_copy(update={"cluster": shape}))
    _edit_stored_config(store, "old-milp", lambda c: {**c, "solver": "milp", "time_limit_s": 2.0})
    with pytest.raises(EplbError, match=r"^solver, cluster\.gpus_per_node, cluster\.num_groups: every rebalance"):
        dep.process_window(store, "old-milp", window(0))
    dep.register(store, "old-milp", config().model_copy(update={"cluster": shape, "solver": "greedy"}))
    assert dep.process_window(store, "old-milp", window(0)).action == "placed"


def test_a_weighted_solver_with_the_time_objective_is_refused_naming_the_config_fields(store: Store) -> None:
    """PUT took solver milp-weighted with objective time, and every window's solve then refused it with 'drop
    --split weighted', a CLI flag of a split the config has no field for. PUT refuses it, naming solver and
    objective; a config stored before is refused alike at its next window; a PUT fixes it."""
    weighted = config().model_copy(update={"solver": "milp-weighted", "time_limit_s": 2.0})
    message = ("the time objective places uniform shares, and solver 'milp-weighted' weights them: choose another "
               "solver ('milp' places uniform ones)")
    with pytest.raises(FieldError) as refused:
        dep.register(store, "weighted", weighted.model_copy(update={"objective": "time"}))
    assert (refused.value.fields, str(refused.value)) == (("solver", "objective"), message)
    dep.register(store, "weighted", weighted)  # the lb objective takes weighted shares
    _edit_stored_config(store, "weighted", lambda c: {**c, "objective": "time"})
    with pytest.raises(FieldError, match="choose another solver") as at_window:
        dep.process_window(store, "weighted", window(0))
    assert at_window.value.fields == ("solver", "objective") and "--" not in str(at_window.value)
    dep.register(store, "weighted", weighted.model_copy(update={"objective": "time", "solver": "milp"}))
    assert dep.process_window(store, "weighted", window(0)).action == "placed"


def test_exports_key_sglang_and_trtllm_by_model_layer(client: TestClient) -> None:
    """A DeepSeek-V3 deployment's whole-model placement (58 MoE layers) exports as SGLang's 61 model layers (the
    3 dense ones get SGLang's trivial map) and TensorRT-LLM's keys 3..60, as `eplb export` does with the layer ids
    of a placement `eplb solve --out` wrote: the rows were the MoE layers, 58 and 0..57."""
    from eplb.io.windows import read_window

    loads = read_window(None).loads
    assert client.put("/deployments/v3", json={"model": "deepseek-v3", "hardware": "h100",
                                                "cluster": {"num_gpus": 32}}).status_code == 201
    placed = client.post("/deployments/v3/windows", json={"loads": loads.tolist()}).json()
    phy2log = placed["result"]["placement"]["phy2log"]
    sglang = client.get("/deployments/v3", params={"format": "sglang"}).json()["physical_to_logical_map"]
    assert len(sglang) == 61 and sglang[3:] == phy2log
    assert sglang[0] == [slot % 256 for slot in range(288)] == sglang[2]
    trtllm = client.get("/deployments/v3", params={"format": "trtllm"}).json()
    assert list(trtllm["initial_global_assignments"]) == [str(i) for i in range(3, 61)]
    assert trtllm["initial_global_assignments"]["3"] == phy2log[0] and trtllm["num_slots"] == 288
    ascend = client.get("/deployments/v3", params={"format": "vllm-ascend"}).json()
    assert ascend["moe_layer_count"] == 58 and ascend["layer_list"][0]["layer_id"] == 0  # its own MoE indexing
    # layer_ids names them (windows of a part of the model name none: their rows stay 0..L-1), MoE layers only
    named = client.get("/deployments/v3", params={"format": "trtllm", "layer_ids": "4-60,3"}).json()
    assert list(named["initial_global_assignments"]) == [*[str(i) for i in range(4, 61)], "3"]
    dense = client.get("/deployments/v3", params={"format": "trtllm", "layer_ids": "0,2-58"})
    assert dense.status_code == 422 and "layer 0 is dense" in dense.json()["detail"], dense.text
    for value, message in (("3-59", "57 ids for the placement's 58 layers"), ("x", "expected numbers"),
                           ("3-59,3", "appears twice")):
        bad = client.get("/deployments/v3", params={"format": "sglang", "layer_ids": value})
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "query.layer_ids", bad.text
        assert message in bad.json()["detail"], bad.text
    assert client.get("/deployments/v3", params={"layer_ids": "3-60"}).status_code == 422


def test_export_layer_ids_are_bounded_by_the_placement_and_the_model(client: TestClient) -> None:
    """`layer_ids=0,99999999999` made to_sglang allocate a table of 10^11 rows (a 500), `0-99999999999` expanded
    the range into a list until memory ran out, and `0,40` wrote 41 SGLang rows for Mixtral's 32 layers. The
    count is bounded by the placement's layers before any range is expanded, and ids by the model's layers."""
    assert client.put("/deployments/mx", json=MIXTRAL).status_code == 201
    assert client.post("/deployments/mx/windows", json={"loads": MIXTRAL_LOADS}).status_code == 200
    for value, message in (("0,99999999999", "beyond any model's"), ("0-99999999999", "beyond any model's"),
                           ("0,40", "layer 40 is beyond the model's 32 layers (0-31)"),
                           ("0-31", "more than the placement's 2 layers"), ("1,1", "layer 1 appears twice"),
                           ("0-9" * 3000, "expected numbers")):
        for target in ("sglang", "trtllm"):
            bad = client.get("/deployments/mx", params={"format": target, "layer_ids": value[:10_000]})
            assert bad.status_code == 422, (value[:40], bad.text)
            assert [e["field"] for e in bad.json()["errors"]] == ["query.layer_ids"], bad.text
            assert message in bad.json()["detail"], bad.text
    rows = client.get("/deployments/mx", params={"format": "sglang", "layer_ids": "30,31"}).json()
    assert len(rows["physical_to_logical_map"]) == 32


def test_the_dense_layer_counts_are_the_presets_sources() -> None:
    import re

    from eplb.specs import MODEL_PRESET_SOURCES

    quoted = {name: int(m.group(1)) for name, text in MODEL_PRESET_SOURCES.items()
              if (m := re.search(r"first_k_dense_replace (\d+)", text))}
    assert quoted == {name: m.first_dense_layers for name, m in MODEL_PRESETS.items() if m.first_dense_layers}
    assert set(quoted) == {"deepseek-v3", "kimi-k2", "deepseek-v2-lite"}
    assert MODEL_PRESETS["deepseek-v3"].num_model_layers == 61


def test_setups_refusals_list_their_fields_in_errors_as_every_422(client: TestClient) -> None:
    """The field-named 422s of a deployment's Setup (config, window, applied placement) had their names in
    `detail` only, no `errors`; a solver that cannot keep groups within nodes was told to 'drop
    --groups/--gpus-per-node', the CLI's flags."""
    cases = [
        ({**MIXTRAL, "model": "gpt-9"}, ["model"], "unknown preset 'gpt-9'"),
        ({**MIXTRAL, "hardware": "tpu"}, ["hardware"], "unknown preset 'tpu'"),
        ({**MIXTRAL, "link": "nvlink+nic"}, ["link", "cluster.gpus_per_node"], "GPUs per node"),
        ({**MIXTRAL, "solver": "simplex"}, ["solver"], "unknown solver 'simplex'"),
        ({**MIXTRAL, "solver": "greedy", "policy": {"max_moves": 10}}, ["solver", "policy.max_moves"],
         "solver 'greedy' does not take policy.max_moves: choose a solver that does"),
        ({**MIXTRAL, "solver": "greedy", "time_limit_s": 5}, ["solver", "time_limit_s"],  # not total_time_limit_s
         "solver 'greedy' does not take time_limit_s: choose a solver that does"),
        ({**MIXTRAL, "solver": "milp", "cluster": HIERARCHICAL}, ["solver", "cluster.gpus_per_node",
                                                                 "cluster.num_groups"], "every rebalance starts"),
        ({**MIXTRAL, "solver": "greedy-coact", "cluster": HIERARCHICAL},
         ["solver", "cluster.gpus_per_node", "cluster.num_groups"],
         "does not keep expert groups within nodes: drop cluster.num_groups/cluster.gpus_per_node or choose one"),
    ]
    for body, fields, message in cases:
        answer = client.put("/deployments/named", json=body)
        assert answer.status_code == 422, answer.text
        problem = answer.json()
        assert [e["field"] for e in problem["errors"]] == fields, problem
        assert all(message in e["message"] for e in problem["errors"]) and message in problem["detail"], problem
    assert "--groups" not in problem["detail"] and "--gpus-per-node" not in problem["detail"]
    assert client.put("/deployments/named", json=MIXTRAL).status_code == 201
    short = client.post("/deployments/named/windows", json={"loads": [[1.0, 2.0]]}).json()
    assert short["errors"] == [{"field": "loads", "message": "the window has 2 experts, but model 'mixtral-8x7b' has "
                                "8: send one row per MoE layer, at most 32 (fewer are a part of the model), of its 8 "
                                "experts"}]  # fmt: skip
    negative = client.post("/deployments/named/windows", json={"loads": [[1.0] * 7 + [-2.0]]}).json()
    assert negative["errors"][0]["field"] == "loads" and negative["detail"] == negative["errors"][0]["message"]
    assert negative["detail"].startswith("loads[0][7] is -2"), negative
    holes = client.post("/deployments/named/placement", json={"placement": WITH_EMPTY_SLOT}).json()
    assert holes["errors"][0]["field"] == "placement.phy2log.0.11", holes
    assert holes["detail"].startswith("placement.phy2log[0][11] is -1, an empty slot")


def test_a_bad_summary_gets_one_answer_from_a_window_and_from_post_placement(client: TestClient) -> None:
    """A deployment's window said 'co-activation summary: missing array ...' (in `errors` too), POST /placement
    'coactivation: missing array ...' (its errors without the prefix): one conversion now
    (`CoactivationSummary.for_window`), the same detail and `errors` from both."""
    import base64
    import io

    import numpy as np

    from eplb.coactivation import summarize

    summary = summarize(np.array([[[0, 1], [0, 5]], [[2, 3], [3, 6]]]), 8)
    image = io.BytesIO()
    np.savez(image, tokens=summary.tokens)  # an .npz image without its other arrays
    other_layers = summary.layers(1)
    loads = summary.loads.astype(float).tolist()
    assert client.put("/deployments/same", json=MIXTRAL).status_code == 201
    for value, detail in ((base64.b64encode(image.getvalue()).decode(), "coactivation: missing array"),
                          ({**summary.to_dict(), "tokens": [1]}, "coactivation: tokens must be [2]"),
                          (other_layers.to_dict(), "coactivation: the summary is for 1 layers x 8 experts, "
                                                   "the loads are 2 x 8")):
        window = client.post("/deployments/same/windows", json={"loads": loads, "coactivation": value})
        placed = client.post("/placement", json={**MIXTRAL, "loads": loads, "coactivation": value})
        assert window.status_code == placed.status_code == 422, (window.text, placed.text)
        assert window.json()["detail"] == placed.json()["detail"], (window.text, placed.text)
        assert window.json()["detail"].startswith(detail), window.text
        assert window.json()["errors"] == placed.json()["errors"], (window.text, placed.text)
        assert [e["field"] for e in window.json()["errors"]] == ["coactivation"], window.text


def test_a_cluster_given_two_slot_budgets_is_refused_naming_the_cluster(client: TestClient) -> None:
    """The rule was checked on the whole config: its 422 named the field `body`, with 'cluster: ...' as the
    message. It names `cluster` now, as POST /placement does for the same rule."""
    for budgets in ({"slots_per_gpu": 4, "num_redundant": 4},
                    {"slots_per_gpu": [4, 4, 4, 4], "memory_budget_bytes": 1e11},
                    {"num_redundant": 4, "memory_budget_bytes": [1e11] * 4}):
        given = [k for k in ("slots_per_gpu", "num_redundant", "memory_budget_bytes") if k in budgets]
        message = f"give only one of slots_per_gpu, num_redundant, memory_budget_bytes (got {given})"
        answer = client.put("/deployments/budgets", json={**MIXTRAL, "cluster": {"num_gpus": 4, **budgets}})
        assert answer.status_code == 422, answer.text
        assert answer.json()["errors"] == [{"field": "cluster", "message": message}], answer.text
        assert answer.json()["detail"] == f"cluster: {message}"
        request = {"model": "mixtral-8x7b", "loads": MIXTRAL_LOADS, "cluster": {"num_gpus": 4, **budgets}}
        assert client.post("/placement", json=request).json()["errors"] == [{"field": "cluster", "message": message}]
    assert client.get("/deployments/budgets").status_code == 404


def test_the_cli_keeps_its_flags_in_the_registrys_groups_refusal() -> None:
    """The registry's message names the JSON fields only when asked to (names=), as the option messages do."""
    problem = registry.Problem(np.zeros((1, 8)), np.array([3, 3, 3, 3]), 2, 2,
                               coactivation=np.zeros((1, 8, 8)))
    with pytest.raises(registry.SolverError, match="drop --groups/--gpus-per-node or choose"):
        registry.check("greedy-coact", problem, Options())
    with pytest.raises(registry.SolverError, match=r"drop cluster\.num_groups/cluster\.gpus_per_node or choose"):
        registry.check("greedy-coact", problem, Options(), names=dep.FIELD_NAMES)


def test_a_config_without_tokens_per_gpu_prices_steps_as_post_placement_does(
    store: Store, client: TestClient
) -> None:
    """Without tokens_per_gpu a deployment priced the whole window as one step (DeepSeek-V3 at EP32: 10.6 s, and the
    cost trigger fired at every window); POST /placement and `eplb solve` take 4,096 tokens per GPU. One default now,
    and a config stored with null reads with it."""
    from api.schemas import CostIn
    from eplb.cli import build_parser
    from eplb.solve import DEFAULT_TOKENS_PER_GPU

    assert dep.DeploymentConfig.model_fields["tokens_per_gpu"].default is DEFAULT_TOKENS_PER_GPU
    assert CostIn.model_fields["tokens_per_gpu"].default is DEFAULT_TOKENS_PER_GPU
    assert build_parser(["solve"]).parse_args(["solve"]).tokens_per_gpu_default is DEFAULT_TOKENS_PER_GPU
    shape = {"model": MODEL, "hardware": "h100", "cluster": {"num_gpus": 8, "slots_per_gpu": 10}}
    put = client.put("/deployments/t", json={**shape, "policy": {"trigger": "cost"}})
    assert put.status_code == 201 and put.json()["config"]["tokens_per_gpu"] == DEFAULT_TOKENS_PER_GPU, put.text
    placed = client.post("/deployments/t/windows", json={"loads": window(0)}).json()
    posted = client.post("/placement", json={**shape, "loads": window(0)}).json()
    assert placed["result"]["placement"] == posted["placement"]
    assert placed["result"]["predicted"]["time_us"] == posted["predicted"]["time_us"]
    assert placed["entry"]["time_after_us"] == pytest.approx(sum(posted["predicted"]["time_us"]), abs=1e-3)
    _edit_stored_config(store, "t", lambda c: {**c, "tokens_per_gpu": None})  # as an older eplb stored it
    assert dep.get(store, "t").config.tokens_per_gpu == DEFAULT_TOKENS_PER_GPU
    again = client.post("/deployments/t/windows", json={"loads": window(0, seed=1)}).json()  # the same hot experts
    assert again["entry"]["time_before_us"] == pytest.approx(placed["entry"]["time_after_us"], rel=0.05), again


BAD_CLUSTERS_AND_LINKS = [
    ({"link": "abc"}, "link"),
    ({"link": "0"}, "link"),
    ({"link": "1e308"}, "link"),
    ({"cluster": {"num_gpus": 8, "memory_budget_bytes": 1}}, "cluster.memory_budget_bytes"),
    ({"cluster": {"num_gpus": 8, "slots_per_gpu": 1}}, "cluster.slots_per_gpu"),
    ({"cluster": {"num_gpus": 80, "num_redundant": 0}}, "cluster.num_redundant"),
]


def _put_refusal(body: dict[str, Any]) -> FieldError:
    """What PUT /deployments/{name} refuses of `body`, without a service: the config model as the route reads the
    JSON, then `check_config` as `register` runs it."""
    with pytest.raises(FieldError) as refused:
        dep.check_config(dep.DeploymentConfig.model_validate_json(json.dumps(body)))
    return refused.value


def _placement_errors(body: dict[str, Any]) -> list[dict[str, str]]:
    """The 422's `errors` POST /placement answers `body`, without a service (its parser, `api.convert`)."""
    from api.convert import Body, parse_placement

    answer = parse_placement(Body(json.dumps(body).encode(), "json", "/placement"), 60.0)
    assert answer.status == 422, answer.body
    errors: list[dict[str, str]] = json.loads(answer.body)["errors"]
    return errors


@pytest.mark.parametrize("change, field", BAD_CLUSTERS_AND_LINKS,
                         ids=["link-abc", "link-0", "link-1e308", "memory_budget_bytes", "slots_per_gpu",
                              "num_redundant"])  # fmt: skip
def test_every_422_of_a_config_names_its_field_in_errors_as_post_placement_does(
    change: dict[str, Any], field: str
) -> None:
    """These 422s had no `errors` (and the budgets' detail named no field: 'a budget of 0.00 GiB on GPU 0 fits no
    expert'); link "1e308" was accepted. The same fields of POST /placement get the same errors (over HTTP, on
    both databases: test_put_refuses_a_config_over_http_naming_its_fields_and_stores_nothing)."""
    from api.problems import field_problem

    body = {"model": MODEL, "hardware": "h100", "cluster": {"num_gpus": 8}, **change}
    problem = field_problem(_put_refusal(body))
    assert problem.errors is not None and [e["field"] for e in problem.errors] == [field], problem.errors
    assert problem.detail.startswith(f"{field}: "), problem.detail
    assert _placement_errors({**body, "loads": window(0)}) == problem.errors


def test_a_bad_name_and_an_export_the_system_cannot_express_name_their_fields(client: TestClient) -> None:
    named = client.put("/deployments/-dash", json=config().model_dump(mode="json", exclude_none=True))
    assert named.status_code == 422 and [e["field"] for e in named.json()["errors"]] == ["path.name"], named.text
    uneven = {"model": MODEL, "hardware": "h100", "cluster": {"num_gpus": 8, "slots_per_gpu": [8] * 7 + [10]}}
    assert client.put("/deployments/uneven", json=uneven).status_code == 201
    assert client.post("/deployments/uneven/windows", json={"loads": window(0)}).status_code == 200
    for target in ("sglang", "trtllm", "vllm-ascend"):
        export = client.get("/deployments/uneven", params={"format": target})
        fields = [e["field"] for e in export.json()["errors"]]
        assert export.status_code == 422 and fields == ["query.format"], export.text


def test_path_and_query_fields_are_named_by_where_they_are(client: TestClient) -> None:
    """The query's limit and before were named query.limit and query.before (FastAPI's own checks), its format and
    layer_ids, and the path's name, bare (the service's checks), so format=xyz was query.format and an export the
    system cannot express format. Every parameter is now named by where it is: path.name, query.format,
    query.layer_ids, query.limit, query.before."""
    body = config().model_dump(mode="json", exclude_none=True)
    assert client.put("/deployments/fields", json=body).status_code == 201
    assert client.post("/deployments/fields/windows", json={"loads": window(0)}).status_code == 200
    asked = [("PUT", "/deployments/-dash", body, None, "path.name"),
             ("GET", "/deployments/-dash", None, None, "path.name"),
             ("DELETE", "/deployments/-dash", None, None, "path.name"),
             ("POST", "/deployments/-dash/windows", {"loads": window(0)}, None, "path.name"),
             ("GET", "/deployments/-dash/history", None, None, "path.name"),
             ("POST", "/deployments/-dash/placement", {"placement": {"phy2log": [[0]], "slots_per_gpu": [1]}}, None,
              "path.name"),
             ("GET", "/deployments/fields", None, {"format": "xyz"}, "query.format"),
             ("GET", "/deployments/fields", None, {"layer_ids": "3-6"}, "query.layer_ids"),
             ("GET", "/deployments/fields", None, {"format": "sglang", "layer_ids": "0,0"}, "query.layer_ids"),
             ("GET", "/deployments/fields/history", None, {"limit": "0"}, "query.limit"),
             ("GET", "/deployments/fields/history", None, {"before": "0"}, "query.before")]
    for method, path, json_body, params, field in asked:
        r = client.request(method, path, json=json_body, params=params)
        assert r.status_code == 422 and [e["field"] for e in r.json()["errors"]] == [field], (method, path, r.text)


def test_a_policy_of_zero_copies_is_refused_at_put_and_a_stored_one_keeps_serving(
    client: TestClient, store: Store, tmp_path: Path
) -> None:
    """policy.max_moves 0 was stored, and every window then 'rebalanced' with 0 moves (last_rebalance advancing). It
    is a 422 at PUT naming the field and the way out; a config stored with it reads, and its windows (forced too)
    are kept with a reason, where Setup refused every window and applied placement with a 422 until a new PUT.
    `eplb solve --max-moves 0` keeps its meaning (the docs': copies allowed, so the serving placement)."""
    from eplb.cli import main

    body = config(max_moves=0).model_dump(mode="json", exclude_none=True)
    put = client.put("/deployments/zero", json=body)
    assert put.status_code == 422 and [e["field"] for e in put.json()["errors"]] == ["policy.max_moves"], put.text
    assert put.json()["detail"] == ("policy.max_moves: 0 copies leave the serving placement as it is, so no "
                                    "rebalance would change anything: give at least 1, or drop policy.max_moves "
                                    "(no budget)")
    assert client.put("/deployments/zero", json=config(max_moves=1).model_dump(mode="json")).status_code == 201
    dep.register(store, "old", config())
    first = dep.process_window(store, "old", window(0))
    _edit_stored_config(store, "old", lambda c: {**c, "policy": {**c["policy"], "max_moves": 0}})
    assert dep.get(store, "old").config.policy.max_moves == 0
    judged = dep.process_window(store, "old", window(1))  # lb above the threshold: it would rebalance
    assert judged.action == "kept" and judged.entry.moves == 0 and judged.result is None, judged
    assert judged.reason == ("policy.max_moves is 0: a rebalance may copy no expert, so the serving placement stays "
                            "(PUT the config with policy.max_moves at least 1, or without it)")
    forced = dep.process_window(store, "old", window(2), force=True)
    assert forced.action == "kept" and forced.reason.startswith("forced by the request, but policy.max_moves is 0")
    assert first.result is not None
    applied = dep.record_applied(store, "old", first.result.placement.model_dump(exclude_none=True))
    assert applied.id == first.history_id  # taken, not refused; it serves already: the entry that placed it
    answer = client.post("/deployments/old/windows", json={"loads": window(3)})
    assert answer.status_code == 200 and answer.json()["action"] == "kept", answer.text
    view = dep.get(store, "old")
    assert view.last_rebalance == 1 and view.windows == 4
    assert view.placement is not None and view.placement.phy2log == first.result.placement.phy2log
    placed, loads = tmp_path / "p.json", tmp_path / "w.json"
    loads.write_text(json.dumps({"loads": window(1)}))
    assert main(["solve", "--loads", str(loads), "--gpus", "8", "--slots-per-gpu", "10", "--out", str(placed)]) == 0
    moved = tmp_path / "w2.json"
    moved.write_text(json.dumps({"loads": window(2)}))
    assert main(["solve", "--loads", str(moved), "--gpus", "8", "--slots-per-gpu", "10", "--current", str(placed),
                 "--max-moves", "0", "--out", str(tmp_path / "q.json")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "q.json").read_text())["phy2log"] == json.loads(placed.read_text())["phy2log"]


@pytest.mark.parametrize("policy, option, owner", [
    ({"trigger": "periodic", "threshold": 1.5}, "threshold", "threshold"),
    ({"trigger": "threshold", "every": 5}, "every", "periodic"),
    ({"trigger": "periodic", "steps": 10}, "steps", "cost"),
    ({"trigger": "threshold", "migration": "blocking"}, "migration", "cost"),
    ({"trigger": "periodic", "migration_stall_s": 0.5}, "migration_stall_s", "cost"),
    ({"every": 5}, "every", "periodic"),
], ids=["threshold", "every", "steps", "migration", "migration_stall_s", "default-trigger"])
def test_an_option_the_policys_trigger_does_not_read_is_refused_as_replay_refuses_it(
    policy: dict[str, Any], option: str, owner: str
) -> None:
    """{"trigger": "periodic", "threshold": 1.5} was stored (the threshold read by nothing), where `eplb replay`
    refuses --threshold without --trigger threshold: one rule now (`eplb.trigger.unused_option`), naming the field
    (over HTTP, on both databases: test_put_refuses_a_config_over_http_naming_its_fields_and_stores_nothing)."""
    body = {**config().model_dump(mode="json", exclude_none=True), "policy": policy}
    refused = _put_refusal(body)
    trigger = policy.get("trigger", "threshold")
    default = "" if "trigger" in policy else " (the default)"
    assert str(refused) == (f"policy.{option} is used by policy.trigger {owner} only; this policy's trigger is "
                            f"{trigger}{default}: use policy.trigger {owner} or drop policy.{option}")
    assert refused.fields == (f"policy.{option}", "policy.trigger")
    fixed = dep.DeploymentConfig.model_validate_json(json.dumps({**body, "policy": {**policy, "trigger": owner}}))
    dep.check_config(fixed)
    stored = dep.explicit_slots(fixed).model_dump(mode="json")  # what GET answers goes back as it is: defaults
    dep.check_config(dep.DeploymentConfig.model_validate_json(json.dumps(stored)))  # are no options


def test_put_refuses_a_config_over_http_naming_its_fields_and_stores_nothing(client: TestClient) -> None:
    """The PUT refusals tested directly above, end to end: the 422's detail and errors, POST /placement's same
    errors for the same fields, nothing stored; the fixed config is registered and what GET answers goes back."""
    body = {**config().model_dump(mode="json", exclude_none=True), "policy": {"trigger": "periodic", "threshold": 1.5}}
    put = client.put("/deployments/stray", json=body)
    assert put.status_code == 422, put.text
    assert put.json()["detail"] == ("policy.threshold is used by policy.trigger threshold only; this policy's trigger "
                                    "is periodic: use policy.trigger threshold or drop policy.threshold")
    assert [e["field"] for e in put.json()["errors"]] == ["policy.threshold", "policy.trigger"]
    assert client.get("/deployments/stray").status_code == 404
    fixed = client.put("/deployments/stray", json={**body, "policy": {"trigger": "threshold", "threshold": 1.5}})
    assert fixed.status_code == 201, fixed.text
    again = client.put("/deployments/stray", json=client.get("/deployments/stray").json()["config"])
    assert again.status_code == 200, again.text
    bad = {"model": MODEL, "hardware": "h100", "cluster": {"num_gpus": 8, "slots_per_gpu": 1}}
    put = client.put("/deployments/bad", json=bad)
    assert put.status_code == 422, put.text
    problem = put.json()
    assert [e["field"] for e in problem["errors"]] == ["cluster.slots_per_gpu"], problem
    assert problem["detail"].startswith("cluster.slots_per_gpu: "), problem
    posted = client.post("/placement", json={**bad, "loads": window(0)})
    assert posted.status_code == 422 and posted.json()["errors"] == problem["errors"], posted.text
    assert client.get("/deployments/bad").status_code == 404


def test_a_config_reads_back_as_it_was_put_to_the_byte(client: TestClient) -> None:
    """PUT, GET and the list answer one serialization of a config (a trial saw migration_stall_s 0 where PUT said
    0.0: jq 1.6 prints 0.0 as 0; the service's bytes agree)."""
    body = {**config(trigger="cost", migration_stall_s=0, steps=10).model_dump(mode="json", exclude_none=True),
            "tokens_per_gpu": 4096}
    put = client.put("/deployments/bytes", json=body)
    got = client.get("/deployments/bytes")
    listed = client.get("/deployments")
    assert put.status_code == 201 and '"migration_stall_s":0.0' in put.text and '"tokens_per_gpu":4096.0' in put.text
    config_text = put.text[put.text.index('"config":'):put.text.index(',"windows"')]
    assert config_text in got.text and config_text in listed.text, (put.text, got.text)


def test_a_long_name_is_echoed_clipped_in_detail_and_instance(client: TestClient) -> None:
    """A 5000-character deployment name came back whole in `detail` (twice for a 404) and in `instance`."""
    name = "a" * 5000
    body = config().model_dump(mode="json", exclude_none=True)
    for method, path, json_body in (("PUT", f"/deployments/{name}", body), ("GET", f"/deployments/{name}", None),
                                    ("DELETE", f"/deployments/{name}", None),
                                    ("POST", f"/deployments/{name}/windows", {"loads": window(0)}),
                                    ("GET", f"/deployments/{name}/history", None), ("GET", f"/jobs/{name}", None)):
        r = client.request(method, path, json=json_body)
        assert r.status_code in (404, 422), (method, path[:40], r.status_code)
        problem = r.json()
        assert len(problem["detail"]) < 250 and "(5,000 characters)" in problem["detail"], (method, problem)
        assert len(problem["instance"]) == 200 and problem["instance"].endswith("\u2026"), (method, problem)
    named = client.put("/deployments/web.1", json=body)
    assert named.status_code == 201
    assert "'web.2': register it with PUT /deployments/web.2" in client.get("/deployments/web.2").json()["detail"]


def test_messages_name_the_window_and_the_json_fields(client: TestClient) -> None:
    """`{"loads": []}` said 'got one row of 0 numbers'; layer_ids=0,0 of a 1-layer placement 'names more than the
    placement's 1 layers'; a greedy-coact window without a summary was told to give '--coactivation FILE'."""
    body = config().model_dump(mode="json", exclude_none=True)
    assert client.put("/deployments/msg", json=body).status_code == 201
    request = {"model": MODEL, "hardware": "h100", "cluster": body["cluster"]}
    empty: list[list[list[float]]] = [[], [[]]]
    for loads in empty:
        for answer in (client.post("/deployments/msg/windows", json={"loads": loads}),
                       client.post("/placement", json={**request, "loads": loads})):
            assert answer.status_code == 422 and [e["field"] for e in answer.json()["errors"]] == ["loads"]
            assert "is empty: a window holds at least one layer of the model's experts" in answer.json()["detail"]
    assert client.post("/deployments/msg/windows", json={"loads": window(0)[:1]}).status_code == 200
    twice = client.get("/deployments/msg", params={"format": "sglang", "layer_ids": "0,0"})
    assert twice.status_code == 422 and twice.json()["errors"] == [
        {"field": "query.layer_ids", "message": "'0,0': layer 0 appears twice: every placement layer is a different "
         "model layer"}], twice.text
    assert client.put("/deployments/coact", json={**body, "solver": "greedy-coact"}).status_code == 201
    window_answer = client.post("/deployments/coact/windows", json={"loads": window(0)})
    placed = client.post("/placement", json={**request, "loads": window(0), "solver": "greedy-coact"})
    for answer in (window_answer, placed):
        assert answer.status_code == 422 and answer.json()["errors"] == [
            {"field": "coactivation", "message": "solver 'greedy-coact' needs the window's co-activation data: give "
             "coactivation, the window's co-activation summary (docs/formats.md)"}], answer.text
        assert "--coactivation" not in answer.text


def test_preset_names_are_case_insensitive_and_stored_as_the_presets(client: TestClient, store: Store) -> None:
    """`eplb solve --model DeepSeek-V3` takes the preset (eplb.specs.model_preset: case-insensitive, spaces ignored),
    but a deployment's config and POST /placement looked names up as given: 'DeepSeek-V2-Lite' and 'H100' were a 422
    'unknown preset'. One lookup now; the config stores the preset's own name, so every later read finds it (the
    view, windows, an export keyed by the preset's model layers)."""
    body = {**config().model_dump(mode="json", exclude_none=True), "model": " DeepSeek-V2-Lite ", "hardware": "H100"}
    put = client.put("/deployments/cased", json=body)
    assert put.status_code == 201, put.text
    assert (put.json()["config"]["model"], put.json()["config"]["hardware"]) == (MODEL, "h100")
    assert dep.get(store, "cased").config == config()
    placed = client.post("/deployments/cased/windows", json={"loads": window(0)})
    assert placed.status_code == 200 and placed.json()["action"] == "placed", placed.text
    assert client.get("/deployments/cased").json()["placement"] == placed.json()["result"]["placement"]
    rows = client.get("/deployments/cased", params={"format": "sglang", "layer_ids": "1-4"}).json()
    assert len(rows["physical_to_logical_map"]) == MODEL_PRESETS[MODEL].num_model_layers
    view, _ = dep.register(store, "cased-direct", config().model_copy(update={"model": "DEEPSEEK-V2-LITE"}))
    assert view.config.model == MODEL and dep.get(store, "cased-direct").config.model == MODEL
    unknown = client.put("/deployments/cased", json={**body, "hardware": "H1000"})
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "hardware"
    assert unknown.json()["detail"].startswith("hardware: unknown preset 'H1000'; known: b200, ")

    lower = client.post("/placement", json={**MIXTRAL, "loads": MIXTRAL_LOADS})
    cased = client.post("/placement", json={**MIXTRAL, "model": "Mixtral-8x7B", "hardware": " H100", "loads":
                                            MIXTRAL_LOADS})
    assert lower.status_code == cased.status_code == 200, cased.text
    assert cased.json()["placement"] == lower.json()["placement"]
    assert cased.json()["predicted"]["time_us"] == lower.json()["predicted"]["time_us"]
    judged = client.post("/evaluate", json={"model": "MIXTRAL-8X7B", "hardware": "h100", "loads": MIXTRAL_LOADS,
                                            "placement": lower.json()["placement"]})
    assert judged.status_code == 200 and judged.json()["predicted"]["lb"] == lower.json()["predicted"]["lb"]
    refused = client.post("/placement", json={**MIXTRAL, "model": "Mixtral-8x7", "loads": MIXTRAL_LOADS})
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "model", refused.text


def test_an_applied_placement_of_other_layers_replaces_the_stored_one_as_a_windows_does(
    client: TestClient, store: Store
) -> None:
    """A window's current_placement replaced a stored placement of another layer count, but the same placement
    POSTed as applied was a 422 ('3 layers, the serving one has 4'): the cluster is the authority on what it serves,
    so both take it (no moves counted, nothing judged before). A placement the model cannot have is still refused,
    by the rule every placement follows (more layers than its MoE layers, other experts)."""
    dep.register(store, "parts-applied", config(trigger="periodic", every=1))
    assert dep.process_window(store, "parts-applied", window(0)).action == "placed"
    serving = solve(np.asarray(window(2)[:3]), dep.Setup(config()).cluster, solver="greedy").placement
    applied = client.post("/deployments/parts-applied/placement", json={"placement": serving.to_dict()})
    assert applied.status_code == 200, applied.text
    entry = applied.json()
    assert entry["action"] == "applied" and entry.get("moves") is None and entry.get("lb_before") is None
    assert dep.get(store, "parts-applied").placement == PlacementOut.model_validate(serving.to_dict())
    judged = dep.process_window(store, "parts-applied", window(1)[:3])  # no current_placement needed now
    lb = evaluate(np.asarray(window(1)[:3], dtype=np.float64), serving).balance.lb_over_tokens()
    assert lb is not None and judged.entry.lb_before == pytest.approx(lb[0], abs=1e-6)
    again = dep.record_applied(store, "parts-applied", serving.to_dict())  # 3 layers on 3: moves counted again
    assert again.moves is not None
    model_layers = MODEL_PRESETS[MODEL].num_moe_layers
    too_many = {"phy2log": [list(range(EXPERTS)) + list(range(16))] * (model_layers + 1), "slots_per_gpu": [10] * 8}
    refused = client.post("/deployments/parts-applied/placement", json={"placement": too_many})
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "placement", refused.text
    assert f"has {model_layers} MoE layers" in refused.json()["detail"]
    other_model = {"phy2log": [list(range(8)) * 10] * 3, "slots_per_gpu": [10] * 8, "num_experts": 8}
    wrong = client.post("/deployments/parts-applied/placement", json={"placement": other_model})
    assert wrong.status_code == 422 and "8 experts, the model has 64" in wrong.json()["detail"], wrong.text
    assert [e.action for e in dep.history(store, "parts-applied").entries] == ["applied", "rebalanced", "applied",
                                                                              "placed"]
