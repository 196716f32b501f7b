"""The compiled token reach (eplb/_reach.c) against the numpy reference it replaced: `step_reach`,
`copies_per_token` and `replica_gpus` give exactly the numpy loop's numbers, every replica rule, with and
without step offsets and nodes."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from eplb import _reach
from eplb import coactivation as co
from eplb.errors import EplbError
from solvers.greedy import solve_greedy

FIXTURE = Path(__file__).parents[1] / "fixtures" / "esft-dsv2lite-law-topk.npz"


def _random_case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(topk_ids [T, L, k] int16, step_offsets with an empty step, phy2log [L, P] with redundant replicas and
    empty slots, uneven slots_per_gpu [8] with an empty GPU, E)."""
    rng = np.random.default_rng(seed)
    tokens, layers, experts, k = 700, 3, 12, 4
    ids = np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :k].astype(np.int16)
    slots = np.array([3, 2, 0, 4, 2, 3, 2, 4])
    extra = int(slots.sum()) - experts
    rows = []
    for _ in range(layers):
        filler = np.where(rng.random(extra) < 0.25, -1, rng.integers(0, experts, extra))
        rows.append(rng.permutation(np.r_[np.arange(experts), filler]))
    offsets = np.array([0, 130, 130, 401, 650, tokens])
    return ids, offsets, np.stack(rows), slots, experts


CASES = list(itertools.product(range(3), co.RULES, [False, True], [None, 2, 4]))


@pytest.mark.parametrize(("seed", "rule", "stepped", "per_node"), CASES)
def test_compiled_reach_equals_the_numpy_loop(seed: int, rule: str, stepped: bool, per_node: int | None) -> None:
    ids, offsets, p2l, slots, experts = _random_case(seed)
    steps = offsets if stepped else None
    new = co.copies_per_token(ids, p2l, slots, experts, gpus_per_node=per_node, rule=rule, step_offsets=steps)
    old = co._copies_numpy(ids, p2l, slots, experts, gpus_per_node=per_node, rule=rule, step_offsets=steps)
    for name in ("gpus", "remote_gpus", "nodes", "remote_nodes"):
        assert np.array_equal(getattr(new, name), getattr(old, name)), name
    span = offsets if stepped else np.array([0, ids.shape[0]])
    reach = co.step_reach(ids, span, p2l, slots, experts, rule, per_node)
    assert reach.shape == (span.size - 1, 3, 8 + (8 // per_node if per_node else 0))
    assert np.array_equal(reach, co._step_reach_numpy(ids, span, p2l, slots, experts, rule, per_node))
    position = None if steps is None else co._step_positions(ids.shape[0], steps)
    assert np.array_equal(co.replica_gpus(ids, p2l, slots, experts, rule, steps),
                          co._replica_gpus(ids, p2l, slots, experts, rule, position))  # fmt: skip


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.float64])
def test_any_integer_ids_route_alike(dtype: type) -> None:
    ids, offsets, p2l, slots, experts = _random_case(7)
    want = co.step_reach(ids, offsets, p2l, slots, experts, "coact", 4)
    assert np.array_equal(co.step_reach(ids.astype(dtype), offsets, p2l, slots, experts, "coact", 4), want)


@pytest.mark.parametrize("rule", co.RULES)
def test_compiled_reach_equals_the_numpy_loop_on_real_routing(rule: str) -> None:
    ids, offsets = co.read_topk(FIXTURE)
    experts, gpus = 64, 8
    slots = np.full(gpus, 10)
    loads = co.pair_counts(ids, experts)[:, np.arange(experts), np.arange(experts)].astype(np.float64)
    p2l = solve_greedy(loads, slots)  # [L, P]
    assert (np.bincount(p2l[0], minlength=experts) > 1).any()  # replicas to choose between
    for per_node in (None, 4):
        new = co.copies_per_token(ids, p2l, slots, experts, gpus_per_node=per_node, rule=rule, step_offsets=offsets)
        old = co._copies_numpy(ids, p2l, slots, experts, gpus_per_node=per_node, rule=rule, step_offsets=offsets)
        assert np.array_equal(new.gpus, old.gpus) and np.array_equal(new.remote_nodes, old.remote_nodes)
        assert np.array_equal(co.step_reach(ids, offsets, p2l, slots, experts, rule, per_node),
                              co._step_reach_numpy(ids, offsets, p2l, slots, experts, rule, per_node))  # fmt: skip


def test_more_picks_than_the_compiled_loop_takes_use_the_numpy_loop() -> None:
    rng = np.random.default_rng(3)
    experts, k = 80, co.MAX_PICKS + 1
    ids = np.argsort(rng.random((30, 1, experts)), axis=2)[:, :, :k]
    p2l, slots = np.r_[np.arange(experts), np.arange(16)][None, :], np.full(8, 12)
    got = co.copies_per_token(ids, p2l, slots, experts, rule="coact")
    assert np.array_equal(got.gpus, co._copies_numpy(ids, p2l, slots, experts, rule="coact").gpus)


def test_bad_picks_are_named() -> None:
    ids, offsets, p2l, slots, experts = _random_case(1)
    lost = p2l.copy()
    lost[1][lost[1] == 5] = -1  # expert 5 loses its slots in layer 1
    want = "layer 1: expert 5 is routed to but has no slot in phy2log"
    with pytest.raises(EplbError, match=want):
        co._copies_numpy(ids, lost, slots, experts)
    with pytest.raises(EplbError, match=want):
        co.copies_per_token(ids, lost, slots, experts)
    with pytest.raises(EplbError, match=want):
        co.step_reach(ids, offsets, lost, slots, experts)
    bad = ids.copy()
    bad[9, 2, 1] = experts  # the numpy loop raised IndexError; a negative id wrapped around to another expert
    with pytest.raises(EplbError, match=f"layer 2: expert id {experts} is outside 0..{experts - 1}"):
        co.replica_gpus(bad, p2l, slots, experts)
    bad[9, 2, 1] = -1
    with pytest.raises(EplbError, match="layer 2: expert id -1 is outside"):
        co.step_reach(bad, offsets, p2l, slots, experts)
    with pytest.raises(EplbError, match="phy2log holds expert 12, beyond the 12 experts"):
        co.step_reach(ids, offsets, np.where(p2l == 3, experts, p2l), slots, experts)
    with pytest.raises(EplbError, match="8 GPUs do not split into nodes of 3"):
        co.step_reach(ids, offsets, p2l, slots, experts, gpus_per_node=3)
    with pytest.raises(EplbError, match="step_offsets must rise"):
        co.step_reach(ids, offsets[::-1], p2l, slots, experts)


def test_kernel_checks_its_buffers() -> None:
    ids, offsets, p2l, slots, experts = _random_case(2)
    table, count = co._replica_tables(p2l, slots, experts)

    def route(out: np.ndarray, offsets: np.ndarray = offsets, per_node: int = 8) -> bool | None:
        return _reach.route(ids, ids.shape[0], 3, 4, offsets, offsets.size - 1, table, count, experts, table.shape[2],
                            0, 8, per_node, 0, 1, out)  # fmt: skip

    assert route(np.zeros((3, 4), dtype=np.int64)) is True
    with pytest.raises(ValueError, match="out: expected 12 items"):
        route(np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="offsets must rise"):
        route(np.zeros((3, 4), dtype=np.int64), offsets=offsets[::-1].copy())
    with pytest.raises(ValueError, match="bad sizes"):
        route(np.zeros((3, 4), dtype=np.int64), per_node=3)  # 8 GPUs in nodes of 3
